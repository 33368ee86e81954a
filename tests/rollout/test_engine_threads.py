"""engine.cpu_threads: how many OpenMP threads a CPU engine gets (the deployed check is in
test_service.py)."""

from services.config import load_config
from services.rollout.engine import cpu_threads

TINY = "deploy/configs/tiny.yaml"


def test_cpu_threads_follow_the_config():
    assert cpu_threads(load_config(TINY, ["engine.cpu_threads=3"])) == 3
    assert cpu_threads(load_config(TINY, ["engine.cpu_threads=-1"])) == 0  # vLLM's own binding
    assert cpu_threads(load_config(TINY, ["engine.cpu_threads=0", "rollout.num_cpus=4.5"])) == 4
    assert cpu_threads(load_config(TINY, ["engine.cpu_threads=0", "rollout.num_cpus=0.25"])) == 1


def test_cpu_threads_reject_a_negative_count_below_minus_one():
    import pytest

    from services.config import ConfigError

    with pytest.raises(ConfigError, match="cpu_threads"):
        load_config(TINY, ["engine.cpu_threads=-2"])
