"""A stable Serve code version for mempo's deployments, so that deploying what already runs is a no-op.

``serve.run`` gives a deployment built in Python a *random* code version unless it has one, so every
``serve.run`` of an unchanged application restarts all its replicas: ``mempo train`` resuming on a
running pipeline restarted every vLLM engine, the scorer and the learner (about a minute on 2 cores),
and ``mempo scale`` replaced the running replicas instead of adding some. Serve also leaves a
deployment's constructor arguments out of the version it compares, so the version must change when
they do. :func:`pinned` therefore sets the version to a digest of the replica config (the constructor
argument; driver-only fields such as replica counts and ``train.steps`` are already left out) and of
the ``services`` package's source: same config and code, same version, running replicas stay; a
replica-count change is a lightweight Serve update; anything else redeploys.

The version of a service covers only the config sections its replicas read
(services/config.py, derived from what each service package declares):
two configs that differ elsewhere (another ``train.run_dir``, ``algorithm.use_memory_reward``, a learner
setting) deploy the search, rollout and scorer replicas that already run, untouched, so ``mempo compare``
restarts only what a variant changes. The replicas are still built with the whole config (the
cross-section validators need it); a kept replica's fields outside its sections are the earlier
config's, which it does not read. The learner reads the whole config and restarts on any change.

``serve deploy`` (deploy/serve_config.yaml) ignores this: Serve versions those applications by the
config file.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

from services.config import sections_read


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """SHA-256 of every ``services/**/*.py`` (path and bytes), computed once per process."""
    root = Path(__file__).resolve().parent  # services/
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def service_slice(replica_config: dict, package: str) -> dict:
    """The part of a replica config that the replicas of ``services/<package>/`` read."""
    keep = sections_read(package)
    if keep is None:
        return dict(replica_config)
    out: dict = {}
    for entry in keep:
        section, _, name = entry.partition(".")
        if section not in replica_config:
            continue
        if name:
            out.setdefault(section, {})[name] = replica_config[section][name]
        else:
            out[section] = replica_config[section]
    return out


def deployment_version(replica_config: dict, package: str) -> str:
    """The code version of the service in ``services/<package>/`` under this replica config."""
    text = json.dumps(service_slice(replica_config, package), sort_keys=True, default=str)
    return hashlib.sha256((source_digest() + package + text).encode()).hexdigest()[:20]


def pinned(deployment, replica_config: dict, package: str):
    """``deployment`` with the code version of its service's config sections and the code (Serve's
    internal option: the public ``options(version=...)`` was removed, and ``serve.run`` otherwise draws
    a random one); ``package`` is the service's package under services/."""
    return deployment.options(version=deployment_version(replica_config, package), _internal=True)
