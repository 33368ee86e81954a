"""Application builders for ``serve deploy`` / ``serve run`` with deploy/serve_config.yaml.

Each service is its own application, built from a mempo config file plus overrides:

    applications:
      - name: scorer
        route_prefix: /scorer
        import_path: services.pipeline.serve_apps:scorer
        args: {config: deploy/configs/tiny.yaml, overrides: ["scorer.replicas=2"]}

The Serve config file's own ``deployments:`` entries (num_replicas, autoscaling_config,
ray_actor_options, user_config) override what the mempo config set. Relative paths (the config
file, world.dir, train.run_dir, model.path, data and index paths) resolve against the project root,
because replicas do not run in the directory ``serve deploy`` was called from. Each builder
builds the embedded world if the config uses it (the first one does; the others find it cached)
and deploys the config with concrete paths, as ``mempo train`` does.

There is one builder per service of the registry (services/pipeline/registry.py), named after it.
"""

from __future__ import annotations

from pathlib import Path

from services.config import MempoConfig, load_config
from services.pipeline.registry import ROOT, SERVICES, application, wired
from services.world.build import prepare_world

_PATH_FIELDS = (("world", "dir"), ("train", "run_dir"), ("model", "path"), ("search", "corpus"),
                ("search", "index_dir"), ("search", "embedding_model"), ("train", "data"), ("train", "sft_data"),
                ("eval", "data"))


def _absolute(value: str) -> str:
    if value in ("", "world") or Path(value).is_absolute():
        return value
    return str(ROOT / value)


def config_from_args(args: dict | None) -> MempoConfig:
    args = dict(args or {})
    unknown = set(args) - {"config", "overrides"}
    if unknown:
        raise ValueError(f"unknown application args {sorted(unknown)}; use 'config' and 'overrides'")
    cfg = load_config(_absolute(args.get("config", "deploy/configs/tiny.yaml")), list(args.get("overrides", [])))
    for section, name in _PATH_FIELDS:
        sec = getattr(cfg, section)
        setattr(sec, name, _absolute(getattr(sec, name)))
    return cfg


def _build(service: str, args: dict | None):
    cfg = config_from_args(args)
    if service == "search" and cfg.search.url:
        raise ValueError(f"search.url={cfg.search.url}: this config calls an external search server and deploys no "
                         f"search application; drop it from the Serve config (mempo plan --serve-config leaves it out)")
    return application(wired(prepare_world(cfg, progress=False)), service)


def _builder(service: str):
    """The application builder ``services.pipeline.serve_apps:<service>`` (Serve wants a function of one
    argument, the application's ``args``)."""
    def build(args: dict | None = None):
        return _build(service, args)

    build.__name__ = build.__qualname__ = service
    build.__doc__ = f"The {service} application of a mempo config (``args``: config, overrides)."
    return build


for _service in SERVICES:
    globals()[_service] = _builder(_service)
del _service
__all__ = ["ROOT", "config_from_args", *SERVICES]
