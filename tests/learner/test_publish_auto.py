"""``learner.publish=auto`` (the default) chooses the path by the size of the weights
(services/learner/collective.py, ``CollectivePublisher.path``): under ``learner.collective_min_mb``
the object store, at or above it the collective; ``collective`` always tries the group. No Ray:
the replicas and the object-store fallback are stubs.

    .venv/bin/python -m pytest -q tests/learner/test_publish_auto.py
"""

import torch

from services.config import load_config
from services.learner.collective import AUTO_GIVE_UP, CollectivePublisher


class _Handle:
    """A deployment handle that records what it is asked (a small publication asks it nothing)."""

    def __init__(self):
        self.calls = []

    def broadcast(self, method, *args):
        self.calls.append(method)
        raise AssertionError(f"{method} called: the object-store path was expected")


class _Fallback:
    def __init__(self):
        self.versions = []

    def publish(self, state, version):
        self.versions.append(version)
        return {"version": version, "replicas": 1}


def _state(mb: float) -> dict:
    return {"w": torch.zeros(int(mb * 1e6) // 4), "ids": torch.arange(3)}  # fp32: 4 bytes a value


def test_auto_is_the_default_and_its_threshold_splits_the_measured_models():
    cfg = load_config("deploy/configs/tiny.yaml")
    assert cfg.learner.publish == "auto"
    # bench/publish.py: the tiny model's 2.0 MB go faster by the object store, SmolLM2-135M bf16's 269 MB
    # (and fp32's 538 MB) by the collective
    assert 2.0 < cfg.learner.collective_min_mb <= 269.0


def test_auto_publishes_a_small_state_by_the_object_store_and_a_large_one_by_the_group():
    handle, fallback = _Handle(), _Fallback()
    pub = CollectivePublisher([handle], "auto", min_bytes=int(16e6))
    pub.fallback = fallback
    small, large = _state(2.0), _state(16.0)
    assert pub.path(small) == "object_store" and pub.path(large) == "collective"

    report = pub.publish(small, 7)
    assert report["path"] == "object_store" and not report["fallback"] and fallback.versions == [7]
    assert handle.calls == [] and pub.pg is None and pub.formation_failures == 0  # no group was tried

    # after AUTO_GIVE_UP failed formations even a large state goes by the object store
    pub.formation_failures = AUTO_GIVE_UP
    assert pub.path(large) == "object_store"


def test_collective_mode_ignores_the_threshold():
    pub = CollectivePublisher([_Handle()], "collective", min_bytes=int(16e6))
    assert pub.path(_state(0.001)) == "collective"
    pub.formation_failures = AUTO_GIVE_UP + 5  # it keeps trying the group (and falls back per publication)
    assert pub.path(_state(0.001)) == "collective"
