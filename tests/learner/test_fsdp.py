"""FSDP2 learner group on CPU (gloo): W=2 equals W=1 after one step; SFT lowers its loss."""

import pytest
import torch
from safetensors.torch import load_file

from services.learner.group import LearnerGroup
from services.learner.samples import global_counts, micro_batches

pytestmark = pytest.mark.slow


def test_samples_and_micro_batches_cover_every_token_once(setup):
    cfg, tb = setup
    n = len(tb.cu_seqlens) - 1
    for world in (1, 2, 3):
        parts = [micro_batches(tb, 2048, r, world) for r in range(world)]
        assert len({len(p) for p in parts}) == 1  # same number of micro-batches on every rank
        seen = sorted(i for p in parts for mb in p for i in mb.samples)
        assert seen == list(range(n))
        assert sum(float(mb.loss_mask.sum()) for p in parts for mb in p) == global_counts(tb)[0]
        assert all(mb.input_ids.numel() <= 2048 or len(mb.samples) == 1 for p in parts for mb in p)


def test_w2_matches_w1_after_one_step(setup, world, uninterrupted):
    cfg, tb = setup
    (m1, sd1, _), (m2, sd2, _) = uninterrupted(1)[0], uninterrupted(2)[0]  # each world size's first step
    assert m1["pg_loss"] == pytest.approx(m2["pg_loss"], rel=1e-5, abs=1e-7)
    assert m1["tokens"] == m2["tokens"] == global_counts(tb)[0]
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-4)
    assert sd1.keys() == sd2.keys()
    # Tolerance: W=2 sums gradients in another order (reduce-scatter), so they differ in the last fp32
    # bits; Adam's first step divides by sqrt(v), which turns that into at most ~1% of one step
    # (lr 1e-3) for parameters whose gradient is ~0. 1e-5 absolute is 1% of the step size.
    for k in sd1:
        torch.testing.assert_close(sd1[k], sd2[k], rtol=1e-5, atol=1e-5)
    init = load_file(str(world / "model" / "model.safetensors"))
    moved = max(float((sd1[k] - init[k]).abs().max()) for k in init)
    assert moved > 1e-4, "one step must change the weights"


def test_noise_scale_over_two_ranks_is_the_one_rank_figure(ray_cluster, setup, world):
    """learner.noise_scale with a prompt group's samples split over two ranks: each group's gradient is
    still whole (summed by the reduce-scatter) when its last round closes, so the estimates match W=1."""
    cfg, tb = setup
    cfg = cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"noise_scale": True})})
    out = {}
    for w in (1, 2):
        group = LearnerGroup(cfg, str(world / "model"), world_size=w)
        try:
            out[w] = group.train_step(tb)
        finally:
            group.shutdown()
    assert out[1]["noise/groups"] == out[2]["noise/groups"] == len(set(tb.group_ids.tolist()))
    for k in ("noise/trace", "noise/signal_sq", "grad_norm"):
        assert out[2][k] == pytest.approx(out[1][k], rel=1e-4, abs=1e-4 * out[1]["noise/trace"]), k


def test_sft_lowers_the_loss(ray_cluster, setup, world):
    cfg, tb = setup
    group = LearnerGroup(cfg, str(world / "model"), world_size=1)
    try:
        group.set_lr(8e-4)  # as `mempo sft` does (learner.sft_lr): the first step's metrics report it
        steps = [group.sft_step(tb) for _ in range(4)]
    finally:
        group.shutdown()
    losses = [m["sft_loss"] for m in steps]
    assert losses[-1] < losses[0] * 0.9, losses
    assert [m["lr"] for m in steps] == [8e-4] * 4
