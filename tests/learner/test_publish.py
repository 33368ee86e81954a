"""Weight publication: after a learner step, a rollout replica and a scorer replica report the new
version and produce outputs that match the learner's weights."""

import httpx
import numpy as np
import pandas as pd
import pytest
import torch
from ray import serve
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.config import load_config
from services.common.messages import TrajectoryBatch
from services.algorithm.advantages import compute_advantages
from services.learner.group import LearnerGroup
from services.learner.publish import ObjectStorePublisher
from services.learner.samples import training_batch
from services.scorer.scorer import MemoryScorer
from services.scorer.service import scorer_app
from services.world.oracle_records import oracle_group
from tests.scorer.test_service import TEXT

pytestmark = pytest.mark.slow


def test_published_weights_reach_rollout_and_scorer(ray_cluster, serve_http, rollout_service, grammar_model, world):
    r_handle, _ = rollout_service
    cfg = load_config("deploy/configs/tiny.yaml", [f"model.path={grammar_model}", "scorer.num_cpus=0.25",
                                                   "learner.lr=1e-3", "learner.num_cpus_per_worker=0.25"])
    s_handle = serve.run(scorer_app(cfg), name="scorer_pub", route_prefix="/scorer_pub")
    tok = AutoTokenizer.from_pretrained(grammar_model)
    row = pd.read_parquet(world / "train.parquet").to_dict("records")[0]
    batch = TrajectoryBatch(groups=[oracle_group(cfg, world, row, n=2, tokenizer=tok)], policy_version=0)
    tb = training_batch(batch, compute_advantages(batch, None, cfg.algorithm))
    group = LearnerGroup(cfg, str(grammar_model), world_size=1)
    try:
        group.sft_step(tb)
        state = group.full_state_dict()
    finally:
        group.shutdown()
    version = r_handle.info.remote().result()["version"] + 10
    publisher = ObjectStorePublisher([r_handle, s_handle])
    report = publisher.publish(state, version)
    try:
        assert report["replicas"] == 2 and report["bytes"] > 0
        assert r_handle.info.remote().result()["version"] == version
        assert s_handle.info.remote().result()["version"] == version

        trained = AutoModelForCausalLM.from_pretrained(grammar_model, dtype=torch.float32).eval()
        trained.load_state_dict(state)
        # rollout: the engine's sampled log-probs are the learner's weights' log-probs
        prompt = [1, 5, 9, 14, 22, 40]
        out = r_handle.generate.remote(prompt, 12, 0.0, 0).result()
        assert out["version"] == version
        with torch.no_grad():
            logits = trained(torch.tensor([prompt + out["token_ids"]])).logits[0, len(prompt) - 1:-1]
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out["token_ids"])[:, None])[:, 0].numpy()
        np.testing.assert_allclose(out["logprobs"], ref, atol=1e-4)
        # scorer: the REST score is the learner's weights' score
        body = httpx.post(f"{serve_http}/scorer_pub/score", json=TEXT, timeout=60).json()
        assert body["policy_version"] == version
        local = MemoryScorer(trained, tok, cfg)
        original = AutoModelForCausalLM.from_pretrained(grammar_model, dtype=torch.float32).eval()
        assert not np.allclose(body["mem_logprobs"], _rest_equivalent(MemoryScorer(original, tok, cfg), TEXT, tok, cfg)["mem_logprobs"], atol=1e-4)
        np.testing.assert_allclose(body["mem_logprobs"], _rest_equivalent(local, TEXT, tok, cfg)["mem_logprobs"], atol=1e-4)
    finally:  # give the shared rollout replica its original weights back
        publisher.publish(load_file(str(grammar_model / "model.safetensors")), version + 1)
        serve.delete("scorer_pub")


def _rest_equivalent(scorer, req, tok, cfg):
    """What POST /score computes for the text form, done locally with ``scorer``'s model."""
    from services.scorer.continuation import build_continuation
    from services.scorer.scorer import text_contexts

    mem, full = text_contexts(tok, cfg.rollout.system_prompt, [req["question"]], req["memory"], req["history"])
    return scorer.score_pair(mem, full, build_continuation(tok, cfg.scorer.answer_template, req["answer"]))
