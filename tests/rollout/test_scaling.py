"""Two rollout replicas: both serve a batch, and a replica killed mid-call loses nothing."""

import threading
import time

import pytest
import ray
from ray import serve

from services.config import load_config
from services.common.data import load_prompts
from services.common.messages import PromptBatch, TrajectoryBatch
from services.common.transport import get_message
from services.rollout.driver import RolloutDriver
from services.rollout.service import rollout_app

pytestmark = pytest.mark.slow
APP = "rollout2"


@pytest.fixture(scope="module")
def two_replicas(search_service, world):
    # the untrained world model never answers, so every episode runs all its turns: calls are long
    # model.path names the session world's model: max_turns shapes the world's key, and replicas never build one
    cfg = load_config("deploy/configs/tiny.yaml", [f"model.path={world / 'model'}", "rollout.replicas=2", "rollout.num_cpus=0.5",
                                                   "rollout.groups_per_call=1", "rollout.max_turns=4",
                                                   "rollout.max_response_tokens=64", "rollout.call_retries=3"])
    handle = serve.run(rollout_app(cfg), name=APP, route_prefix=None)
    yield handle, cfg
    serve.delete(APP)


def _collect(refs):
    return [get_message(r, TrajectoryBatch) for r in refs]


def test_both_replicas_serve_a_batch(two_replicas, world):
    handle, cfg = two_replicas
    prompts = load_prompts(world / "test.parquet", cfg.rollout.system_prompt, limit=6)
    out = _collect(RolloutDriver(handle, cfg).rollout(PromptBatch(prompts=prompts, n=2, policy_version=0)))
    assert len(out) == 6
    assert len({b.replica for b in out}) == 2, [b.replica for b in out]
    assert [b.groups[0].prompt.uid for b in out] == [p.uid for p in prompts]


def _replica_actor_names():
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{APP}#")]


def test_a_replica_killed_mid_call_loses_and_duplicates_nothing(two_replicas, world):
    handle, cfg = two_replicas
    prompts = load_prompts(world / "test.parquet", cfg.rollout.system_prompt, limit=8)
    driver = RolloutDriver(handle, cfg)
    result = {}

    def run():
        result["refs"] = driver.rollout(PromptBatch(prompts=prompts, n=2, policy_version=0))

    worker = threading.Thread(target=run)
    worker.start()
    # kill a replica that is generating now (a fixed sleep raced the calls on a fast machine: every
    # call had finished before the kill): ask replicas until one reports turns running
    deadline, victim = time.monotonic() + 300, None
    while victim is None and time.monotonic() < deadline and worker.is_alive():
        info = handle.info.remote().result()
        if info["turns_running"] > 0:
            victim = next(n for n in _replica_actor_names() if n.endswith(info["replica"]))
    assert victim is not None, "no replica was seen generating before the calls ended"
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    worker.join(timeout=600)
    assert not worker.is_alive()
    out = _collect(result["refs"])
    uids = [g.prompt.uid for b in out for g in b.groups]
    assert uids == [p.uid for p in prompts]  # every prompt group exactly once, in order
    assert all(sorted(e.sample for e in g.episodes) == [0, 1] for b in out for g in b.groups)
    assert driver.stats["retries"] >= 1, driver.stats
