"""The service registry: every service of the pipeline, said once.

    for name, svc in SERVICES.items(): ...    # search, rollout, scorer, learner, in deploy order
    svc.app(cfg)           # the bound Serve application (what `mempo train` and serve_apps deploy)
    svc.options(cfg)       # its deployment options (`mempo plan`, the resource check, the Serve config)
    svc.driver(handle, cfg)  # what the training loop calls (None: the bare handle)
    svc.sections           # the config sections its replicas read (derived: services/config.py)
    svc.restart            # what a replica Serve starts in place of a dead one needs (RESTART_RULES)

Every place that lists the services reads this table: services/pipeline/apps.py (``application``,
``Pipeline.start``, ``wired``, ``scale``), services/pipeline/plan.py (``deployments``, the Serve config),
services/pipeline/serve_apps.py (one builder per service), ``mempo serve --apps`` and ``mempo scale``;
the Serve code version (services/serve_version.py) reads the sections each service package
declares in its settings.py. A new service is one entry here and its package (docs/extending.md);
tests/pipeline/test_registry.py checks that they agree.

A service's builder, options and driver are named as ``"module:attribute"`` and imported on first use:
the service modules import Ray, torch, FastAPI and vLLM's dependencies at their top, and neither
``mempo --help`` nor the plan's arithmetic should wait for those.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from services.config import sections_read

if TYPE_CHECKING:  # only a type here: the registry stays a leaf that `mempo --help` reads cheaply
    from services.config import MempoConfig

ROOT = Path(__file__).resolve().parents[2]  # the project root: serve_apps' relative paths resolve against it

# What a replica that Serve starts in place of a dead one needs before it serves.
RESTART_RULES = {
    "ready": "nothing: it serves as it starts (the search index is read from disk)",
    "resync": "the current policy: it starts from model.path, so the pipeline publishes the learner's weights "
              "to it before a retried call (Pipeline.resync); it is a publish target of the learner",
    "resume": "its checkpoint: the one stateful replica resumes from the run's latest complete checkpoint, and "
              "its calls are never retried (a step must not be applied twice)",
}


def _load(path: str) -> Callable:
    """The attribute named by ``"module:attribute"``."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class Service:
    """One service: its Serve application (``app_builder(cfg)``), deployment options
    (``options_fn(cfg)``), driver class (``driver_class(handle, cfg)``; None: the training loop uses
    the bare handle), HTTP route without an ``ray.app_prefix`` (None: in-cluster only), restart rule
    (``RESTART_RULES``) and whether ``mempo scale`` resizes it (its section's ``replicas``)."""

    name: str
    app_builder: str
    options_fn: str
    driver_class: Optional[str]
    route: Optional[str]
    restart: str
    scalable: bool

    @property
    def package(self) -> str:
        """Its package under services/ (the one its app builder lives in)."""
        return self.app_builder.split(".")[1]

    @property
    def sections(self) -> tuple[str, ...] | None:
        """The config sections its replicas read (None: every one), as its package declares them."""
        return sections_read(self.package)

    def app(self, cfg: MempoConfig):
        return _load(self.app_builder)(cfg)

    def options(self, cfg: MempoConfig) -> dict:
        return _load(self.options_fn)(cfg)

    def driver(self, handle, cfg: MempoConfig, watch=None, before_retry=None) -> Any:
        """The training loop's client of the deployment, whole when built: its replica watch, and what runs
        before a retried call (used by the "resync" restart rule only)."""
        if self.driver_class is None:
            return handle
        return _load(self.driver_class)(handle, cfg, watch=watch,
                                        before_retry=before_retry if self.restart == "resync" else None)


SERVICES: dict[str, Service] = {s.name: s for s in (
    Service("search", "services.search_tool.service:search_app", "services.search_tool.service:deployment_options",
            None, "/", "ready", True),
    Service("rollout", "services.rollout.service:rollout_app", "services.rollout.service:deployment_options",
            "services.rollout.driver:RolloutDriver", None, "resync", True),
    Service("scorer", "services.scorer.service:scorer_app", "services.scorer.service:deployment_options",
            "services.scorer.driver:ScorerDriver", "/scorer", "resync", True),
    Service("learner", "services.learner.service:learner_app", "services.learner.service:deployment_options",
            "services.learner.driver:LearnerDriver", None, "resume", False),
)}

# The services that hold a copy of the policy: the learner publishes each new policy to them.
POLICY_HOLDERS = tuple(name for name, s in SERVICES.items() if s.restart == "resync")


def service(name: str) -> Service:
    if name not in SERVICES:
        raise ValueError(f"unknown service {name!r}; choose from {', '.join(SERVICES)}")
    return SERVICES[name]


def app_name(cfg: MempoConfig, name: str) -> str:
    return f"{cfg.ray.app_prefix}{name}"


def route_prefix(cfg: MempoConfig, name: str) -> str | None:
    """Where a service's HTTP endpoint is: its route, or ``/{ray.app_prefix}{name}`` with a prefix."""
    route, p = service(name).route, cfg.ray.app_prefix
    return None if route is None else f"/{p}{name}" if p else route


def application(cfg: MempoConfig, name: str):
    """The bound Serve application of one service."""
    return service(name).app(cfg)


def wired(cfg: MempoConfig) -> MempoConfig:
    """The config with the cross-service names following ``ray.app_prefix``."""
    if not cfg.ray.app_prefix:
        return cfg
    cfg = cfg.model_copy(deep=True)
    cfg.rollout.search_app = app_name(cfg, "search")
    cfg.learner.publish_to = [f"{app_name(cfg, name)}:{name}" for name in POLICY_HOLDERS]
    return cfg
