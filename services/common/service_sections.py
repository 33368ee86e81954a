"""The config sections a service's replicas read, derived from what its package declares.

    sections_read("rollout")   # (..., 'world', 'ray', 'learner.tempered_logprobs', 'learner.lora')
    sections_read("learner")   # None: every section

A service package owns the sections its ``settings.py`` defines (services/common/config.py composes
them into the tree) and names in ``READS`` the other sections (or single fields, ``"rollout.system_prompt"``)
its replicas read; ``READS = None`` means every section. The map is these two put together, so there is
no table to keep by hand: a new section read is one word next to the code that reads it, and
tests/common/test_service_sections.py scans each package for the sections its code touches.

A service's Serve code version (services/common/serve_version.py) covers only its sections, so a
config change restarts exactly the services that read what changed (``mempo compare`` keeps the rest).
The pipeline's registry (services/pipeline/registry.py) gives each service its package.
"""

from __future__ import annotations

import functools
import importlib

from services.common.config import MempoConfig


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
