"""The Serve code version of mempo's deployments (services/serve_version.py), without Ray."""

import pytest

from services.config import load_config, replica_config
from services.serve_version import deployment_version, service_slice

TINY = "deploy/configs/tiny.yaml"
PACKAGES = ("search_tool", "rollout", "scorer", "learner")  # the four services' packages


def versions(overrides: list[str]) -> dict[str, str]:
    config = replica_config(load_config(TINY, overrides))
    return {s: deployment_version(config, s) for s in PACKAGES}


def test_same_config_same_version_and_driver_fields_do_not_count():
    a = versions([])
    assert versions(["train.steps=99", "rollout.replicas=3", "scorer.call_retries=5"]) == a  # running replicas stay
    assert len(set(a.values())) == len(PACKAGES)  # each service has its own version


def test_a_config_change_the_replicas_see_changes_the_version():
    a, b = versions([]), versions(["rollout.temperature=0.5"])
    assert {s for s in PACKAGES if a[s] != b[s]} == {"rollout", "learner"}  # Serve redeploys those
    c = versions(["rollout.system_prompt=Answer."])
    assert {s for s in PACKAGES if a[s] != c[s]} == {"rollout", "scorer", "learner"}  # the scorer's REST default


def test_the_slice_keeps_only_the_services_sections():
    config = replica_config(load_config(TINY))
    assert set(service_slice(config, "search_tool")) == {"search", "world", "ray"}
    assert service_slice(config, "scorer")["rollout"] == {"system_prompt": config["rollout"]["system_prompt"]}
    assert service_slice(config, "learner") == config
    with pytest.raises(ValueError, match="unknown service package 'critic'"):
        service_slice(config, "critic")
