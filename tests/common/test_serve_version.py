"""The Serve code version of mempo's deployments (services/common/serve_version.py), without Ray."""

from services.common.config import load_config, replica_config
from services.common.serve_version import deployment_version


def test_same_config_same_version_and_driver_fields_do_not_count():
    a = load_config("deploy/configs/tiny.yaml")
    b = load_config("deploy/configs/tiny.yaml", ["train.steps=99", "rollout.replicas=3", "scorer.call_retries=5"])
    assert deployment_version(replica_config(a)) == deployment_version(replica_config(b))  # running replicas stay


def test_a_config_change_the_replicas_see_changes_the_version():
    a = load_config("deploy/configs/tiny.yaml")
    b = load_config("deploy/configs/tiny.yaml", ["rollout.temperature=0.5"])
    assert deployment_version(replica_config(a)) != deployment_version(replica_config(b))  # Serve redeploys
