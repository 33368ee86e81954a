"""The building blocks of every config section: the section base class, field marks and shared types.

Each service declares its own section in its package (``services/<package>/settings.py``) from these
pieces; services/config.py composes the sections into one tree. A leaf: it imports pydantic only.

    class SearchConfig(Section):
        topk: int = Field(
            3, ge=1, json_schema_extra=RUNTIME,
            description="Passages per search call.",
        )
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

PositiveInt = Annotated[int, Field(ge=1)]
BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the offending field(s)."""


def _custom_resources(value: dict) -> dict:
    for name in value:
        if not name or name in BUILTIN_RESOURCES or name.startswith("node:"):
            raise ValueError(f"{name!r} is not a custom resource name (CPUs and GPUs have their own fields; "
                             f"'node:' names are Ray's own)")
    return value


CustomResources = Annotated[dict[str, Annotated[float, Field(ge=0)]], AfterValidator(_custom_resources)]


# Field marks (json_schema_extra), read by fields_marked(): a RUNTIME field may change on running
# replicas (a Serve user_config, no restart); a RULE field is also runtime and defines the memory
# reward, so every score echoes it (the REST response, MemoryScoreBatch).
RUNTIME = {"runtime": True}
RULE = {"runtime": True, "rule": True}


def baseline(name: str, title: str, value: Any, default: bool = False) -> dict:
    """A field mark for a knob that exists to make a baseline: setting the field to ``value`` is the
    baseline ``name`` of `mempo compare` (services/pipeline/compare.py collects these marks into its
    VARIANTS registry), so a new knob and its baseline are one field here."""
    return {"baseline": {"name": name, "title": title, "value": value, "default": default}}


def field_baselines(root: type[BaseModel]) -> list[tuple[str, str, str, bool]]:
    """(name, title, "section.field=value", default) for every field of ``root``'s sections marked
    with baseline(), in declaration order."""
    out = []
    for section_name, section in root.model_fields.items():
        for name, f in getattr(section.annotation, "model_fields", {}).items():
            mark = f.json_schema_extra.get("baseline") if isinstance(f.json_schema_extra, dict) else None
            if mark:
                value = str(mark["value"]).lower() if isinstance(mark["value"], bool) else mark["value"]
                out.append((mark["name"], mark["title"], f"{section_name}.{name}={value}", mark["default"]))
    return out


def fields_marked(section: type[BaseModel], mark: str) -> tuple[str, ...]:
    """The names of a section's fields carrying ``mark`` ("runtime" or "rule"), in declaration order."""
    return tuple(n for n, f in section.model_fields.items() if isinstance(f.json_schema_extra, dict)
                 and f.json_schema_extra.get(mark))


class Section(BaseModel):
    """A config section: unknown keys fail, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)
