"""The one typed configuration tree of the mempo pipeline, composed from the sections the packages own.

Each service declares its own section next to its code (``services/<package>/settings.py``: search,
rollout, scorer, learner and algorithm, world, train and eval); the sections every service reads
(model, engine, ray) live in services/common/settings.py. Every knob is a pydantic field with a help
string on its own lines and, where MemPO's reference implementation fixes a number (see
docs/algorithm.md), that number as its default. A run's config is a YAML file from ``deploy/configs/``
plus ``key.sub=value`` overrides from the command line:

    from services.config import load_config
    cfg = load_config("deploy/configs/tiny.yaml", ["rollout.n=4", "scorer.tau=-1.0"])

    python -m services.config deploy/configs/tiny.yaml rollout.n=4   # print the result
    python -m services.config --help-fields                          # every field, documented

Unknown keys and bad values fail at load time with :class:`ConfigError`, naming the field.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import re
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

# The composition: the one place common imports a service package, and only its settings module,
# which imports nothing but common's config leaves (tests/test_layering.py), so no import comes back.
from services.common.config_fields import ConfigError, Section, field_baselines, fields_marked  # noqa: F401 (re-exported)
from services.common.settings import EngineConfig, ModelConfig, RayConfig
from services.learner.settings import AlgorithmConfig, LearnerConfig
from services.pipeline.settings import EvalConfig, TrainConfig
from services.rollout.settings import RolloutConfig
from services.scorer.settings import ScorerConfig
from services.search_tool.settings import SearchConfig
from services.world.settings import WorldConfig


# A command's config when it names none (`mempo sft`, `mempo data transcripts`, ...): the laptop scale.
DEFAULT_CONFIG = str(Path(__file__).resolve().parents[1] / "deploy" / "configs" / "tiny.yaml")


def config_args(args: list[str]) -> tuple[str, list[str]]:
    """(config path, key=value overrides) of a command's positional arguments: the first is the config
    file unless it is an override; none = ``DEFAULT_CONFIG``."""
    path = args[0] if args and "=" not in args[0] else DEFAULT_CONFIG
    return path, [a for a in args if a is not path]


class MempoConfig(Section):
    """Root of the config tree: one section per concern."""

    world: WorldConfig = Field(default_factory=WorldConfig, description="The embedded synthetic world.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Policy model (and the tiny model's shape).")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="vLLM engine arguments.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="The agent loop.")
    search: SearchConfig = Field(default_factory=SearchConfig, description="Retrieval service.")
    scorer: ScorerConfig = Field(default_factory=ScorerConfig, description="Memory reward scoring.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="Rewards and advantages.")
    learner: LearnerConfig = Field(default_factory=LearnerConfig, description="Policy update and FSDP.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="The training loop.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Held-out evaluation.")
    ray: RayConfig = Field(default_factory=RayConfig, description="Ray cluster and Serve.")

    @model_validator(mode="after")
    def _scorer_budget_fits_the_model(self) -> "MempoConfig":
        positions = model_positions(self)
        if self.scorer.max_request_tokens > positions:
            raise ValueError(f"scorer.max_request_tokens: {self.scorer.max_request_tokens} exceeds the model's "
                             f"{positions} positions (engine.max_model_len, model.max_position_embeddings)")
        return self

    @model_validator(mode="after")
    def _budgets_and_groups_fit(self) -> "MempoConfig":
        r = self.rollout
        if r.max_context_tokens + r.max_response_tokens > self.engine.max_model_len:
            raise ValueError(f"rollout.max_response_tokens: rollout.max_context_tokens ({r.max_context_tokens}) + "
                             f"rollout.max_response_tokens ({r.max_response_tokens}) exceeds engine.max_model_len "
                             f"({self.engine.max_model_len}): a turn near the context limit would get a cut response "
                             f"budget; lower one or raise the engine length")
        return self


def model_positions(cfg: MempoConfig, loaded: int | None = None) -> int:
    """Longest sequence the policy can take: engine.max_model_len, the world model's
    model.max_position_embeddings, and ``loaded`` (a loaded model's own), whichever is least."""
    caps = [cfg.engine.max_model_len] + ([cfg.model.max_position_embeddings] if cfg.model.path == "world" else [])
    return min(caps + ([loaded] if loaded else []))


def scorer_token_budget(cfg: MempoConfig, loaded_positions: int | None = None) -> int:
    """Tokens one REST scoring request may take: scorer.max_request_tokens (0 = the model's positions),
    never more than the model's positions."""
    positions = model_positions(cfg, loaded_positions)
    return min(cfg.scorer.max_request_tokens or positions, positions)


# Where a check lives: one field's own rule is its validator (it holds wherever the section is built,
# MempoConfig or the section alone, and pydantic names the field); a rule over several fields sits on
# the lowest model holding them all (the root for fields of two sections) and starts its message with
# the field to change, "section.field: why", which becomes that error's location.
_NAMED = re.compile(r"([a-z_]+(?:\.[a-z_]+)+): (.*)", re.S)


def _format_errors(err: ValidationError) -> str:
    """One line per offending field; union alternatives of one field are merged into its line."""
    by_field: dict[str, list[str]] = {}
    for e in err.errors():
        # pydantic adds the tried union member ("constrained-int", "literal['full']") to the path
        loc = ".".join(str(p) for p in e["loc"] if isinstance(p, int) or str(p).isidentifier())
        if e["type"] == "extra_forbidden":
            msg = f"unknown key{_suggest(loc)}"
        elif e["type"] == "value_error" and (named := _NAMED.match(e["msg"].removeprefix("Value error, "))):
            # a cross-field check, "section.field: why": on the root (its location is empty) or on a section
            # (its location the section's, which the message names already)
            loc, msg = named[1] if named[1].startswith(f"{loc}.") else ".".join(p for p in (loc, named[1]) if p), named[2]
        elif not e["loc"]:
            loc, msg = "config", e["msg"].removeprefix("Value error, ")
        else:
            msg = f"{e['msg'].removeprefix('Value error, ')} (got {e.get('input')!r})"
        if msg not in by_field.setdefault(loc, []):
            by_field[loc].append(msg)
    lines = [f"{loc}: {' | '.join(msgs)}" for loc, msgs in by_field.items()]
    return "invalid config:\n  " + "\n  ".join(lines)


def _field_paths(model: type[BaseModel] = MempoConfig, prefix: str = "") -> list[str]:
    out = []
    for name, f in model.model_fields.items():
        path = f"{prefix}{name}"
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.extend(_field_paths(ann, path + "."))
        else:
            out.append(path)
    return out


def _suggest(key: str) -> str:
    # compare like with like: a misspelt section against section names, a leaf against leaf paths
    candidates = [p for p in _field_paths() + list(MempoConfig.model_fields) if p.count(".") == key.count(".")]
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"rollout.n=8"`` -> (["rollout", "n"], 8). Values are parsed as YAML scalars/lists."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"{key}: value {raw!r} is not valid YAML: {e}") from None
    return key.split("."), value


def _apply(tree: dict, path: list[str], value: Any) -> None:
    model: type[BaseModel] = MempoConfig
    node = tree
    for i, part in enumerate(path):
        dotted = ".".join(path[: i + 1])
        if part not in model.model_fields:
            raise ConfigError(f"{dotted}: unknown key{_suggest(dotted)}")
        ann = model.model_fields[part].annotation
        if i == len(path) - 1:
            node[part] = value
        else:
            if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
                raise ConfigError(f"{dotted}: is a value, not a section")
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{dotted}: expected a section")
            model = ann


def _merged(under: dict, over: dict) -> dict:
    """``over`` laid on ``under``: mappings merge key by key, anything else (a list, a value) replaces."""
    out = dict(under)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def read_config_tree(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict:
    """A config file's sections as a dict. A file may start from another: a top-level ``base: other.yaml``
    (relative to the file) is read first and this file's sections are merged over it, key by key, so a
    variant of a recipe holds only what it changes:

        base: gpu-qwen2.5-7b.yaml
        learner: {lr: 1.0e-5, world_size: 1, lora: {rank: 64}}
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist" + (f" (the base of {_chain[-1]})" if _chain else ""))
    if p.resolve() in _chain:
        raise ConfigError(f"{p}: its bases come back to it: {' -> '.join(str(c) for c in (*_chain, p.resolve()))}")
    try:
        loaded = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{p}: top level must be a mapping of sections")
    base = loaded.pop("base", None)
    if base is None:
        return loaded
    if not isinstance(base, str) or not base.strip():
        raise ConfigError(f"{p}: base: must be the path of another config file (relative to this one), got {base!r}")
    return _merged(read_config_tree(p.parent / base, (*_chain, p.resolve())), loaded)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> MempoConfig:
    """Load a YAML config (or the defaults if ``path`` is None; ``base:`` in it: ``read_config_tree``)
    and apply ``key=value`` overrides."""
    tree: dict = read_config_tree(path) if path is not None else {}
    for ov in overrides:
        keys, value = parse_override(ov)
        _apply(tree, keys, value)
    try:
        return MempoConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_errors(e)) from None


def updated_section(section: BaseModel, changes: dict, allowed: tuple[str, ...]) -> BaseModel:
    """A validated copy of a config section with ``changes`` applied (a Serve deployment's
    ``user_config``); keys outside ``allowed`` (the fields safe to change at runtime) fail."""
    bad = sorted(set(changes or {}) - set(allowed))
    if bad:
        raise ConfigError(f"user_config: {bad} cannot change at runtime; allowed: {', '.join(allowed)}")
    try:
        return type(section).model_validate({**section.model_dump(), **(changes or {})})
    except ValidationError as e:
        raise ConfigError(_format_errors(e)) from None


# Replica counts are Serve deployment options, and the loop's length and eval cadence only concern
# the driver: leaving them out of the config replicas are built with makes "more rollout replicas"
# or "train for longer" a lightweight Serve update (running replicas stay) instead of a redeploy.
_DRIVER_ONLY_FIELDS = {"rollout": {"replicas"}, "scorer": {"replicas", "call_retries"},
                       "search": {"replicas", "autoscaling", "min_replicas", "max_replicas", "target_ongoing_requests"},
                       "train": {"steps", "eval_every", "max_staleness", "prompts_per_step", "over_sampling", "pause_rollout"},
                       "eval": True}


def replica_config(cfg: MempoConfig) -> dict:
    """The config dict a deployment's replicas are constructed with (driver-only fields left out)."""
    return cfg.model_dump(mode="json", exclude=_DRIVER_ONLY_FIELDS)


def learner_worker_gpus(cfg: "MempoConfig") -> float:
    """GPUs per learner FSDP worker: one wherever the policy runs on GPUs (the rollout or scorer use them, or
    learner.backend is nccl), else none. Read from the config, not from ``torch.cuda.is_available()``: the
    learner group is built inside the learner's Serve replica, which asks Ray for no GPU and may see none."""
    return 1.0 if cfg.rollout.num_gpus or cfg.scorer.num_gpus or cfg.learner.backend == "nccl" else 0.0


def actor_options(num_cpus: float, num_gpus: float = 0.0, resources: dict | None = None) -> dict:
    """Ray actor options of a replica or worker: CPUs, GPUs and, where a config names them, custom
    resources (left out when empty, so a config without placement deploys as before)."""
    out = {"num_cpus": num_cpus, "num_gpus": num_gpus}
    if resources:
        out["resources"] = dict(resources)
    return out


def to_yaml(cfg: MempoConfig) -> str:
    """The full resolved config as YAML (every field, defaults included)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


def describe_fields(model: type[BaseModel] = MempoConfig, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(dotted key, default, help) for every leaf field of the tree."""
    rows = []
    for name, f in model.model_fields.items():
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows.extend(describe_fields(ann, f"{prefix}{name}."))
        else:
            runtime = isinstance(f.json_schema_extra, dict) and f.json_schema_extra.get("runtime")
            rows.append((f"{prefix}{name}", f.get_default(call_default_factory=True),
                         (f.description or "") + (" [runtime: a Serve user_config changes it on running replicas]"
                                                  if runtime else "")))
    return rows


# -- the sections each service reads ----------------------------------------------------------------
# A service package owns the sections its ``settings.py`` defines and names in ``READS`` the other sections
# (or single fields, ``"rollout.system_prompt"``) its replicas read; ``READS = None`` means every section. A
# service's Serve code version (services/serve_version.py) covers only these, so a config change restarts
# exactly the services that read what changed; tests/test_config_sections.py scans each package for the
# sections its code touches.

@functools.lru_cache(maxsize=None)
def sections_read(package: str) -> tuple[str, ...] | None:
    """The config sections the replicas of ``services/<package>/`` read (None: every one): the sections
    its settings module defines, then its ``READS``. A ValueError for a package with no settings module."""
    name = f"services.{package}.settings"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name not in (name, f"services.{package}"):
            raise
        raise ValueError(f"unknown service package {package!r}: services/{package}/settings.py declares a "
                         f"service's config sections") from None
    if not hasattr(module, "READS"):
        raise ValueError(f"{name} declares no READS (the other config sections its replicas read, or None)")
    if module.READS is None:
        return None
    owned = tuple(section for section, field in MempoConfig.model_fields.items()
                  if field.annotation.__module__ == name)
    return owned + tuple(module.READS)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv and argv[0] == "--help-fields":
        for key, default, help_ in describe_fields():
            print(f"{key} = {default!r}\n    {help_}")
        return 0
    path = argv.pop(0) if argv and "=" not in argv[0] else None
    try:
        print(to_yaml(load_config(path, argv)), end="")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
