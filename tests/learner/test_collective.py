"""Collective weight publication (learner.publish=collective, services/learner/collective.py): the
replicas serve exactly what the object-store path gives them, and a replica killed during a
publication costs a bounded wait on either path (the collective: one fallback), not a hung learner.

    .venv/bin/python -m pytest -q -x tests/learner/test_collective.py
"""

import time

import httpx
import numpy as np
import pytest
import ray
import torch
from ray import serve
from safetensors.torch import load_file

from services.config import load_config
from services.learner.collective import CollectivePublisher
from services.learner.publish import ObjectStorePublisher
from services.scorer.service import scorer_app
from tests.scorer.test_service import TEXT

pytestmark = pytest.mark.slow


def _new_policy(model_dir, seed: int = 0) -> dict:
    """The model's weights moved by a seeded perturbation: a policy neither replica holds."""
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.02 * torch.randn(v.shape, generator=gen, dtype=v.dtype) if v.is_floating_point() else v
            for k, v in load_file(str(model_dir / "model.safetensors")).items()}


def _served(r_handle, serve_http: str, route: str) -> tuple:
    """What the replicas now produce: the engine's greedy tokens and log-probs, the scorer's REST score."""
    out = r_handle.generate.remote([1, 5, 9, 14, 22, 40], 12, 0.0, 0).result()
    body = httpx.post(f"{serve_http}/{route}/score", json=TEXT, timeout=60).json()
    return out, body


def _cfg(grammar_model, *extra):
    return load_config("deploy/configs/tiny.yaml", [f"model.path={grammar_model}", "scorer.num_cpus=0.1", *extra])


def test_collective_publication_serves_what_the_object_store_serves(ray_cluster, serve_http, rollout_service,
                                                                     grammar_model):
    r_handle, _ = rollout_service
    s_handle = serve.run(scorer_app(_cfg(grammar_model)), name="scorer_coll", route_prefix="/scorer_coll")
    state = _new_policy(grammar_model)
    version = r_handle.info.remote().result()["version"] + 10
    pub = CollectivePublisher([r_handle, s_handle], "collective", form_timeout_s=30)
    try:
        report = pub.publish(state, version)
        assert report["path"] == "collective" and report["group_rebuilt"] and report["replicas"] == 2
        assert r_handle.info.remote().result()["version"] == version
        assert s_handle.info.remote().result()["version"] == version
        out_c, body_c = _served(r_handle, serve_http, "scorer_coll")
        assert out_c["version"] == version and body_c["policy_version"] == version

        ObjectStorePublisher([r_handle, s_handle]).publish(state, version + 1)
        out_o, body_o = _served(r_handle, serve_http, "scorer_coll")
        # bit-identical weights: the same tokens and the same log-probs, to the last bit
        assert out_o["token_ids"] == out_c["token_ids"] and out_o["logprobs"] == out_c["logprobs"]
        assert body_o["mem_logprobs"] == body_c["mem_logprobs"] and body_o["r_mem"] == body_c["r_mem"]

        # the next publication reuses the group; a different policy is served
        again = pub.publish(_new_policy(grammar_model, seed=1), version + 2)
        assert again["path"] == "collective" and not again["group_rebuilt"]
        out_2, _ = _served(r_handle, serve_http, "scorer_coll")
        assert out_2["version"] == version + 2 and not np.allclose(out_2["logprobs"], out_c["logprobs"], atol=1e-6)
    finally:  # give the shared rollout replica its original weights back
        pub.close()
        ObjectStorePublisher([r_handle]).publish(load_file(str(grammar_model / "model.safetensors")), version + 3)
        serve.delete("scorer_coll")


def _replica_actors(app: str) -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{app}#")]


@pytest.mark.parametrize("path", ["collective", "object_store"])
def test_a_replica_killed_during_publication_costs_a_bounded_wait_on_either_path(ray_cluster, serve_http,
                                                                                  grammar_model, path):
    """collective: a scorer replica killed among the broadcast's chunks; the publication falls back to
    the object store. object_store: a replica killed as the publication starts; its call fails
    (counted in replicas_gone) instead of hanging. Either way the live replica takes the version and
    the next publication reaches Serve's replacement too."""
    app = f"scorer_kill_{path}"
    cfg = _cfg(grammar_model, "scorer.replicas=2")
    handle = serve.run(scorer_app(cfg), name=app, route_prefix=f"/{app}")
    killed = []

    def kill_one(stage):
        if stage == "sending" and not killed:
            killed.append(_replica_actors(app)[0])
            ray.kill(ray.get_actor(killed[0], namespace="serve"), no_restart=True)

    if path == "collective":  # 64 KiB buckets: the tiny model goes out in many chunks, the kill lands among them
        pub = CollectivePublisher([handle], "collective", bucket_bytes=64 << 10, form_timeout_s=20, hook=kill_one)
    else:
        pub = ObjectStorePublisher([handle])
    state = _new_policy(grammar_model)
    try:
        t0 = time.perf_counter()
        if path == "object_store":
            kill_one("sending")
        report = pub.publish(state, 5)
        assert killed and time.perf_counter() - t0 < 60  # the learner went on: no hang on the dead peer
        if path == "collective":
            assert report["path"] == "object_store" and report["fallback"]
        assert report["replicas"] >= 1 and all(v == 5 for v in _versions(handle))
        # Serve replaces the dead replica (it starts from model.path); the next publication (by the
        # collective: in a new group) reaches both
        deadline = time.monotonic() + 180
        while len(_replica_actors(app)) < 2 or len(_versions(handle)) < 2:
            assert time.monotonic() < deadline, "Serve did not replace the killed scorer replica"
            time.sleep(1)
        pub.hook = None
        again = pub.publish(state, 6)
        assert again["replicas"] == 2 and _versions(handle) == [6, 6]
        if path == "collective":
            assert again["path"] == "collective" and again["group_rebuilt"]
        print(f"\n[fault] {path}: replica killed during publication: {report.get('total_s', 0):.2f}s, "
              f"replicas gone {report.get('replicas_gone', 0)}")
    finally:
        if path == "collective":
            pub.close()
        serve.delete(app)


def _versions(handle) -> list[int]:
    from services.learner.publish import broadcast

    return [r["version"] for r in broadcast(handle, "info")[0]]


class _Reply:
    def __init__(self, value):
        self.value = value

    def results(self, timeout_s=None, return_exceptions=False):
        return [self.value]


class _NoGroupReplica:
    """A deployment handle whose one replica cannot join a weight group (e.g. no route to the learner)."""

    def __init__(self):
        self.versions = []

    def broadcast(self, method, *args):
        if method == "weight_group":
            return _Reply(None)
        if method == "join_weight_group":
            return _Reply(RuntimeError("no route to the learner's store"))
        assert method == "update_weights"
        self.versions.append(args[1])
        return _Reply({"version": args[1]})


def test_auto_falls_back_and_stops_trying_after_failed_formations(ray_cluster, caplog):
    from services.learner.collective import AUTO_GIVE_UP

    replica = _NoGroupReplica()
    pub = CollectivePublisher([replica], "auto", form_timeout_s=1)
    state = {"w": torch.ones(3)}
    with caplog.at_level("WARNING", logger="mempo.learner"):
        paths = [pub.publish(state, v)["path"] for v in range(AUTO_GIVE_UP + 2)]
    assert paths == ["object_store"] * (AUTO_GIVE_UP + 2) and replica.versions == list(range(AUTO_GIVE_UP + 2))
    assert pub.formation_failures == AUTO_GIVE_UP  # no group tried after the third failure
    assert "goes by the object store" in caplog.text and "object store from now on" in caplog.text
