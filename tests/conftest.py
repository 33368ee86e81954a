"""Session-wide fixtures: one local Ray cluster and one embedded world for the whole test run.

Heavy things (Ray, the world, a vLLM engine) are created once per session and shared; tests that
need them ask for the fixture. GPU-only tests are marked ``gpu`` and skip without CUDA.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster shared by every test of the session."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=2, object_store_memory=400_000_000, include_dashboard=False,
                 log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()
