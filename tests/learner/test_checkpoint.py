"""Sharded checkpoints: kill-and-resume equals an uninterrupted run; incomplete ones are skipped;
the HF export loads in transformers."""

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from services.learner.checkpoint import MARKER, latest_complete, step_dir
from services.learner.group import LearnerGroup

pytestmark = pytest.mark.slow


def test_latest_complete_skips_incomplete(tmp_path):
    assert latest_complete(tmp_path) is None
    for step, complete in [(2, True), (4, True), (6, False)]:
        d = step_dir(tmp_path, step)
        d.mkdir(parents=True)
        (d / "__0_0.distcp").write_bytes(b"partial")
        if complete:
            (d / MARKER).write_text("ok\n")
    assert latest_complete(tmp_path) == step_dir(tmp_path, 4)


def _train(group, tb, steps):
    for _ in range(steps):
        group.train_step(tb)


def test_kill_and_resume_equals_uninterrupted(ray_cluster, setup, world, tmp_path, uninterrupted):
    cfg, tb = setup
    model = str(world / "model")
    _, *expected = uninterrupted(2)[3]  # the W=2 run after 4 steps: (state dict, optimizer digest)

    run = str(tmp_path / "run")
    first = LearnerGroup(cfg, model, world_size=2)
    _train(first, tb, 2)
    first.save_checkpoint(run, 2, {"data_position": 16})
    for w in first.workers:  # a crash: no clean shutdown
        ray.kill(w)
    step_dir(run, 3).mkdir(parents=True)  # a later checkpoint killed mid-write
    (step_dir(run, 3) / "__0_0.distcp").write_bytes(b"half")

    second = LearnerGroup(cfg, model, world_size=2)
    try:
        state = second.resume(run)
        assert state == {"step": 2, "extra": {"data_position": 16}}
        _train(second, tb, 2)
        got = (second.full_state_dict(), second.optimizer_digest())
        out = second.export_hf(str(tmp_path / "hf"), model)
    finally:
        second.shutdown()
    for k in expected[0]:
        torch.testing.assert_close(got[0][k], expected[0][k], rtol=0, atol=0)
    assert got[1] == pytest.approx(expected[1], rel=1e-12)
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for k, v in exported.state_dict().items():
        torch.testing.assert_close(v, got[0][k])


@pytest.mark.parametrize("before,after", [(1, 2), (2, 1)])
def test_resume_at_another_world_size(ray_cluster, setup, world, tmp_path, before, after, uninterrupted):
    """A checkpoint written by W ranks resumes on W' ranks (state resharded, RNG mapped r -> r % W) and
    the next step is the uninterrupted run's: the ranks' gradients sum to the full-batch gradient at
    any W, so the loss and the weights agree up to the float order of that sum."""
    cfg, tb = setup
    model = str(world / "model")
    metrics, expected, _ = uninterrupted(before)[2]  # the uninterrupted W run's third step
    expected_loss = metrics["pg_loss"]

    run = str(tmp_path / "run")
    first = LearnerGroup(cfg, model, world_size=before)
    try:
        _train(first, tb, 2)
        first.save_checkpoint(run, 2, {"data_position": 16})
    finally:
        first.shutdown()
    assert sorted(p.name for p in step_dir(run, 2).glob("rng_rank*.pt")) == [f"rng_rank{r}.pt" for r in range(before)]

    second = LearnerGroup(cfg, model, world_size=after)
    try:
        assert second.resume(run) == {"step": 2, "extra": {"data_position": 16}}
        got_loss = second.train_step(tb)["pg_loss"]
        got = second.full_state_dict()
    finally:
        second.shutdown()
    assert got_loss == pytest.approx(expected_loss, rel=1e-4, abs=1e-6)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-4, atol=1e-5)


def test_bf16_resume_keeps_the_fp32_masters(ray_cluster, setup, world, tmp_path):
    """``model.dtype=bfloat16``: the checkpoint holds the fp32 master weights and AdamW state, not the
    bf16 copies the forward uses, so a resumed run goes on exactly as the uninterrupted one (a resume
    from bf16-rounded weights would shift the masters' digest by ~1e-3 relative)."""
    cfg, tb = setup
    cfg = cfg.model_copy(deep=True)
    cfg.model.dtype = "bfloat16"
    model = str(world / "model")
    ref = LearnerGroup(cfg, model, world_size=1)
    try:
        _train(ref, tb, 2)
        expected = (ref.param_digest(), ref.optimizer_digest(), ref.full_state_dict())
    finally:
        ref.shutdown()

    run = str(tmp_path / "run")
    first = LearnerGroup(cfg, model, world_size=1)
    try:
        _train(first, tb, 1)
        first.save_checkpoint(run, 1)
    finally:
        first.shutdown()
    second = LearnerGroup(cfg, model, world_size=1)
    try:
        assert second.resume(run)["step"] == 1
        _train(second, tb, 1)
        got = (second.param_digest(), second.optimizer_digest(), second.full_state_dict())
    finally:
        second.shutdown()
    assert got[0] == pytest.approx(expected[0], rel=1e-12) and got[1] == pytest.approx(expected[1], rel=1e-12)
    for k, v in expected[2].items():
        assert got[2][k].dtype == torch.bfloat16
        torch.testing.assert_close(got[2][k], v, rtol=0, atol=0)
