"""The learner deployment: one MemPO step from real rollout and scorer messages, published back (by the
object store and by the collective, ``learner.publish``)."""

import pytest
from ray import serve

from services.config import load_config
from services.common.data import load_prompts
from services.common.messages import PromptBatch
from services.learner.service import learner_app
from services.rollout.driver import RolloutDriver
from services.scorer.service import scorer_app

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("publish", ["object_store", "collective"])
def test_one_step_from_rollout_and_scores_to_new_version(ray_cluster, serve_http, rollout_service, grammar_model,
                                                          world, tmp_path, publish):
    r_handle, r_cfg = rollout_service
    v0 = r_handle.info.remote().result()["version"]
    cfg = load_config("deploy/configs/tiny.yaml", [
        f"model.path={grammar_model}", "scorer.num_cpus=0.25", "learner.num_cpus_per_worker=0.25",
        "learner.checkpoint_every=1", f"train.run_dir={tmp_path / 'run'}",
        "learner.publish_to=[rollout:rollout, scorer_l:scorer]", f"learner.publish={publish}"])
    s_handle = serve.run(scorer_app(cfg), name="scorer_l", route_prefix="/scorer_l")
    l_handle = serve.run(learner_app(cfg), name="learner", route_prefix=None)
    try:
        assert l_handle.info.remote().result()["version"] == 0
        prompts = load_prompts(world / "train.parquet", r_cfg.rollout.system_prompt, k=2, limit=2)
        traj_refs = RolloutDriver(r_handle, r_cfg).rollout(PromptBatch(prompts=prompts, n=4, policy_version=v0, seed=5))
        score_refs = [s_handle.score.remote(ref)._to_object_ref_sync() for ref in traj_refs]
        out = l_handle.step.remote(traj_refs, score_refs).result()
        m = out["metrics"]
        assert out["groups"] and all("episodes" in g for g in out["groups"])  # for groups.jsonl, beside the metrics
        assert m["version"] == 1 and m["step"] == 1 and m["samples"] > 0 and m["tokens"] > 0
        # the update publishes nothing by itself: the loop's next line does (services/pipeline/train.py)
        assert r_handle.info.remote().result()["version"] == v0 and "published_replicas" not in m
        p = l_handle.publish.remote().result()
        assert p["published_replicas"] == 2 and p["published_version"] == 1 and p["publish_s"] > 0
        assert p.get("publish_collective") == (1.0 if publish == "collective" else None)  # no fallback
        assert r_handle.info.remote().result()["version"] == 1
        assert s_handle.info.remote().result()["version"] == 1
        assert "checkpoint" in m and (tmp_path / "run" / "checkpoints" / "step_00000001" / "COMPLETE").is_file()
        for key in ("pg_loss", "logprob_abs_diff_mean", "logprob_max_ratio", "entropy", "grad_norm", "reward_mean"):
            assert key in m, key
        assert m["logprob_abs_diff_mean"] < 1e-3  # the rollout sampled with the same weights
    finally:
        serve.delete("learner")
        serve.delete("scorer_l")
        # the shared rollout replica gets its original weights back (a new version)
        from safetensors.torch import load_file

        from services.common.codec import encode
        from services.common.messages import WeightUpdate

        v = r_handle.info.remote().result()["version"] + 1
        r_handle.update_weights.remote(encode(WeightUpdate(version=v, tensors=load_file(str(grammar_model / "model.safetensors")))), v).result()
