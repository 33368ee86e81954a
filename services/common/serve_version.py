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

``serve deploy`` (deploy/serve_config.yaml) ignores this: Serve versions those applications by the
config file.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """SHA-256 of every ``services/**/*.py`` (path and bytes), computed once per process."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def deployment_version(replica_config: dict) -> str:
    text = json.dumps(replica_config, sort_keys=True, default=str)
    return hashlib.sha256((source_digest() + text).encode()).hexdigest()[:20]


def pinned(deployment, replica_config: dict):
    """``deployment`` with the code version of this config and code (Serve's internal option: the
    public ``options(version=...)`` was removed, and ``serve.run`` otherwise draws a random one)."""
    return deployment.options(version=deployment_version(replica_config), _internal=True)
