"""The learner's models as services/learner/shard.py builds them, in a LearnerWorker in this process
(FSDP2 over gloo, world size 1), no Ray:

* mixed precision that trains: with ``model.dtype`` bfloat16 the policy keeps fp32 master weights
  and AdamW state, computes in bf16, and one AdamW step at lr 1e-6 changes (nearly) every weight,
  as in fp32; AdamW stepping bf16 weights directly changes under 1% of them;
* activation checkpointing gives the step it replaces: the same loss, gradient norm and weights."""

import pytest
import torch

from services.common.codec import encode
from services.learner.worker import LearnerWorker

pytestmark = pytest.mark.slow


def worker(world, cfg, **learner) -> LearnerWorker:
    cfg = cfg.model_copy(update={"learner": cfg.learner.model_copy(update=learner)})
    w = LearnerWorker(0, 1, cfg.model_dump(mode="json"), str(world / "model"))
    w.join(*w.store_address())
    return w


def masters(model) -> dict[str, torch.Tensor]:
    return {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for n, p in model.named_parameters()}


def changed_share(before: dict, after: dict) -> float:
    changed = sum(int((before[n] != after[n]).sum()) for n in before)
    return changed / sum(t.numel() for t in before.values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_adamw_step_at_lr_1e6_changes_nearly_every_weight(setup, world, dtype):
    cfg, tb = setup
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"dtype": dtype})})
    w = worker(world, cfg, lr=1e-6)
    try:
        before = masters(w.model)
        assert all(t.dtype == torch.float32 for t in before.values()), "master weights are fp32"
        m = w.train_step(encode(tb))
        assert m["skipped_steps"] == 0.0
        after = masters(w.model)
        share = changed_share(before, after)
        assert share > 0.95, f"{dtype}: one step changed {share:.1%} of the weights"
        state = w.full_state_dict()  # what vLLM and the scorer load: model.dtype
        assert {v.dtype for v in state.values() if v.is_floating_point()} == {getattr(torch, dtype)}
        for st in w.optim.state.values():
            assert all(v.dtype == torch.float32 for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
        if dtype == "bfloat16":
            # The old way, AdamW stepping bf16 weights: its first step moves each weight by ~lr * sign(grad),
            # so the fp32 step's signs stand in for the gradients. Most of those moves round away.
            params = {n: torch.nn.Parameter(t.to(torch.bfloat16)) for n, t in before.items()}
            for n, p in params.items():
                p.grad = torch.sign(after[n] - before[n]).to(torch.bfloat16)
            torch.optim.AdamW(params.values(), lr=1e-6, weight_decay=cfg.learner.weight_decay).step()
            direct = changed_share({n: t.to(torch.bfloat16) for n, t in before.items()},
                                   {n: p.detach() for n, p in params.items()})
            assert direct < 0.2, f"bf16 AdamW changed {direct:.1%} of the weights"
    finally:
        w.shutdown()


def test_activation_checkpointing_gives_the_same_step(setup, world):
    cfg, tb = setup
    out = {}
    for ac in (False, True):
        w = worker(world, cfg, activation_checkpointing=ac)
        try:
            assert w.model.model.gradient_checkpointing is ac
            out[ac] = (w.train_step(encode(tb)), w.full_state_dict())
        finally:
            w.shutdown()
    (m0, sd0), (m1, sd1) = out[False], out[True]
    assert m1["pg_loss"] == pytest.approx(m0["pg_loss"], rel=1e-6, abs=1e-8)
    assert m1["grad_norm"] == pytest.approx(m0["grad_norm"], rel=1e-5)
    for k in sd0:  # lr 1e-3 Adam: the same last-bit tolerance as W=2 against W=1 (tests/learner/test_fsdp.py)
        torch.testing.assert_close(sd1[k], sd0[k], rtol=1e-5, atol=1e-5)


def test_tempered_logprobs_follow_the_rollout_temperature(setup, world):
    """learner.tempered_logprobs: a step's log-probs and entropy are those of logits / rollout.temperature (a
    sharper distribution at 0.5: lower entropy, another gradient; the on-policy loss itself is -mean(A) at any
    temperature, the ratio being 1); greedy rollouts (temperature 0) or the option
    off leave the untempered step."""
    cfg, tb = setup
    out = {}
    for tempered, temperature in ((False, 0.5), (True, 0.5), (True, 0.0)):
        c = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"temperature": temperature})})
        w = worker(world, c, tempered_logprobs=tempered)
        try:
            out[tempered, temperature] = w.train_step(encode(tb))
        finally:
            w.shutdown()
    plain, sharp, greedy = out[False, 0.5], out[True, 0.5], out[True, 0.0]
    assert sharp["tokens"] == plain["tokens"] > 0
    assert sharp["entropy"] < 0.9 * plain["entropy"], (sharp["entropy"], plain["entropy"])
    assert sharp["grad_norm"] != pytest.approx(plain["grad_norm"], rel=1e-3)
    assert greedy["entropy"] == pytest.approx(plain["entropy"], rel=1e-6)
    assert greedy["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-6)
