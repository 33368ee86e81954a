"""The rollout engine serving a LoRA policy (``learner.lora.publish: adapter``): vLLM's LoRA support on the
grammar model, each published adapter a new adapter id, its log-probs those of peft's layers (what the
learner and the scorer compute), a wrong adapter refused with the engine still serving."""

import asyncio

import numpy as np
import pytest
import torch

from services.config import load_config

pytestmark = pytest.mark.slow

TINY = "deploy/configs/tiny.yaml"
RANK = 8


@pytest.fixture(scope="module")
def lora_engine(grammar_model):
    from services.rollout.engine import PolicyEngine, close_engine

    cfg = load_config(TINY, [f"model.path={grammar_model}", f"learner.lora.rank={RANK}", "learner.lora.publish=adapter",
                             "rollout.num_cpus=0.5"])
    loop = asyncio.new_event_loop()

    async def start():
        return PolicyEngine(cfg, grammar_model)

    engine = loop.run_until_complete(start())
    yield engine, cfg, loop
    close_engine(engine, loop)


def _adapters(model_dir, lora, seed: int) -> dict[str, torch.Tensor]:
    """Adapter tensors of ``lora``'s shapes on the model, A and B both non-zero (B starts at 0 in training)."""
    from services.common.lora import adapter_shapes

    g = torch.Generator().manual_seed(seed)
    return {k: 0.08 * torch.randn(shape, generator=g) for k, shape in adapter_shapes(str(model_dir), lora).items()}


def _greedy(engine, loop, ids: list[int], n: int = 12):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=n, logprobs=0, seed=0, ignore_eos=True)
    return loop.run_until_complete(engine.generate(ids, params))


def _peft_logprobs(model_dir, lora, adapters, ids: list[int], out: list[int]) -> np.ndarray:
    """The sampled tokens' log-probs under the base with peft's LoRA layers holding ``adapters`` (None: the base)."""
    from transformers import AutoModelForCausalLM

    from services.common.lora import add_adapters

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapters is not None:
        add_adapters(model, lora)
        model.load_state_dict(adapters, strict=False)
    with torch.no_grad():
        logits = model(torch.tensor([ids + out])).logits[0, len(ids) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(out)[:, None])[:, 0].numpy()


def test_the_engine_serves_each_adapter_with_peft_logprobs(lora_engine, grammar_model):
    engine, cfg, loop = lora_engine
    lora = cfg.learner.lora
    ids = [1, 5, 9, 14, 22, 40]
    base = _greedy(engine, loop, ids)
    assert base.version == 0 and engine.adapter is None
    for version, seed in ((1, 0), (2, 1)):
        adapters = _adapters(grammar_model, lora, seed)
        loop.run_until_complete(engine.update_weights(adapters, version))
        out = _greedy(engine, loop, ids)
        assert out.version == version
        ref = _peft_logprobs(grammar_model, lora, adapters, ids, out.token_ids)
        np.testing.assert_allclose(out.logprobs, ref, atol=1e-4)
        # the adapter changes the policy: the base gives these tokens other log-probs
        assert np.abs(_peft_logprobs(grammar_model, lora, None, ids, out.token_ids) - ref).max() > 1e-2
        # one adapter held: the previous version's is removed from the engine and its folder deleted
        held = loop.run_until_complete(engine.engine.list_loras())
        assert set(held) == {engine.adapter.lora_int_id}
        folders = sorted(p.name for p in engine._weights_dir.iterdir() if p.name.startswith("adapter-"))
        assert folders == [f"adapter-{engine.adapter.lora_int_id}"]


def test_an_adapter_of_another_rank_is_refused_and_the_engine_keeps_serving(lora_engine, grammar_model):
    engine, cfg, loop = lora_engine
    before = engine.version
    other = cfg.learner.lora.model_copy(update={"rank": 16})
    with pytest.raises(ValueError, match=f"learner.lora.rank={RANK}"):
        loop.run_until_complete(engine.update_weights(_adapters(grammar_model, other, 3), before + 1))
    narrower = cfg.learner.lora.model_copy(update={"target_modules": ["q_proj"]})
    with pytest.raises(ValueError, match="target_modules"):
        loop.run_until_complete(engine.update_weights(_adapters(grammar_model, narrower, 3), before + 1))
    out = _greedy(engine, loop, [1, 5, 9])
    assert out.version == before and len(out.token_ids) == 12


def test_the_slot_rank_is_the_smallest_vllm_serves():
    from services.rollout.engine import lora_slot_rank

    assert [lora_slot_rank(r) for r in (1, 2, 8, 9, 16, 300, 512)] == [1, 8, 8, 16, 16, 320, 512]
    with pytest.raises(ValueError, match="learner.lora.rank=600"):
        lora_slot_rank(600)


def test_an_engine_restarted_in_place_serves_the_adapter_it_held(lora_engine, grammar_model):
    """The fault path of a replica in adapter mode: its vLLM process killed, ``ensure_alive`` restarts it on the
    base and re-adds the adapter of the version it held; the same greedy tokens and log-probs come back."""
    import os
    import signal
    import time

    engine, cfg, loop = lora_engine
    version = engine.version + 1
    loop.run_until_complete(engine.update_weights(_adapters(grammar_model, cfg.learner.lora, 7), version))
    ids = [1, 5, 9, 14, 22, 40]
    before = _greedy(engine, loop, ids)
    os.kill(engine.pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not engine.engine.errored and time.monotonic() < deadline:
        loop.run_until_complete(asyncio.sleep(0.5))
    assert loop.run_until_complete(engine.ensure_alive())
    after = _greedy(engine, loop, ids)
    assert after.version == version and after.token_ids == before.token_ids
    np.testing.assert_allclose(after.logprobs, before.logprobs, atol=1e-5)
