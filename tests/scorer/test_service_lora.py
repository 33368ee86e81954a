"""The scorer serving a LoRA policy (``learner.lora.publish: adapter``): peft's layers on the base, each
published adapter scored as the same adapters merged into the weights are (the other publication mode),
a wrong adapter refused with the replica still scoring."""

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from services.common.codec import encode
from services.common.messages import WeightUpdate
from tests.scorer.test_service import TEXT

pytestmark = pytest.mark.slow

RANK = 8


@pytest.fixture(scope="module")
def lora_scorer(serve_http, grammar_model):
    from ray import serve

    from services.config import load_config
    from services.scorer.service import scorer_app

    cfg = load_config("deploy/configs/tiny.yaml", [f"model.path={grammar_model}", "scorer.num_cpus=0.25",
                                                   f"learner.lora.rank={RANK}", "learner.lora.publish=adapter"])
    handle = serve.run(scorer_app(cfg), name="scorer-lora", route_prefix="/scorer-lora")
    yield handle, f"{serve_http}/scorer-lora", cfg
    serve.delete("scorer-lora")


def test_an_adapter_scores_as_its_merged_weights(lora_scorer, scorer_service, grammar_model):
    from services.common.lora import adapter_shapes, merge_state

    handle, url, cfg = lora_scorer
    plain_handle, plain_url, _ = scorer_service
    lora = cfg.learner.lora
    base = httpx.post(f"{url}/score", json=TEXT, timeout=60).json()
    plain = httpx.post(f"{plain_url}/score", json=TEXT, timeout=60).json()
    np.testing.assert_allclose(base["mem_logprobs"], plain["mem_logprobs"], atol=1e-5)  # version 0: the base

    g = torch.Generator().manual_seed(0)
    adapters = {k: 0.08 * torch.randn(s, generator=g) for k, s in adapter_shapes(str(grammar_model), lora).items()}
    assert handle.update_weights.remote(encode(WeightUpdate(version=3, tensors=adapters)), 3).result()["version"] == 3
    after = httpx.post(f"{url}/score", json=TEXT, timeout=60).json()
    assert after["policy_version"] == 3
    assert np.abs(np.subtract(after["mem_logprobs"], base["mem_logprobs"])).max() > 1e-2

    original = load_file(str(grammar_model / "model.safetensors"))
    merged = merge_state({**original, **adapters}, lora)  # the plain weights with the adapters folded in
    version = plain["policy_version"]
    plain_handle.update_weights.remote(encode(WeightUpdate(version=version + 1, tensors=merged)), version + 1).result()
    try:
        as_merged = httpx.post(f"{plain_url}/score", json=TEXT, timeout=60).json()
        for key in ("mem_logprobs", "full_logprobs"):
            np.testing.assert_allclose(after[key], as_merged[key], atol=1e-4)
    finally:
        plain_handle.update_weights.remote(encode(WeightUpdate(version=version + 2, tensors=original)),
                                           version + 2).result()


def test_a_full_state_dict_or_another_rank_is_refused(lora_scorer, grammar_model):
    from services.common.lora import adapter_shapes

    handle, url, cfg = lora_scorer
    before = httpx.post(f"{url}/score", json=TEXT, timeout=60).json()
    with pytest.raises(Exception, match="learner.lora"):
        handle.update_weights.remote(encode(WeightUpdate(version=10, tensors=load_file(
            str(grammar_model / "model.safetensors")))), 10).result()
    wider = cfg.learner.lora.model_copy(update={"rank": 16})
    other = {k: torch.zeros(s) for k, s in adapter_shapes(str(grammar_model), wider).items()}
    with pytest.raises(Exception, match=f"learner.lora.rank={RANK}"):
        handle.update_weights.remote(encode(WeightUpdate(version=10, tensors=other)), 10).result()
    again = httpx.post(f"{url}/score", json=TEXT, timeout=60).json()
    assert again["policy_version"] == before["policy_version"]
    np.testing.assert_allclose(again["mem_logprobs"], before["mem_logprobs"], atol=1e-6)
