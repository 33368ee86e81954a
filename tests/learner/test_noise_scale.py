"""learner.noise_scale: the gradient noise scale of a step over its prompt groups.

* the estimator (services/learner/noise_scale.py) is unbiased for the mean gradient's squared norm and
  the trace of a group's gradient covariance, on synthetic draws;
* by-group micro-batches (services/learner/samples.py) never mix groups, end each group with a round
  the ranks share, and cover every sample once;
* in a LearnerWorker (FSDP2, gloo, W=1) the groups' squared gradient norms are those of each group's
  samples trained alone, and the update is the one taken without the measurement."""

import numpy as np
import pytest
import torch

from services.common.codec import encode
from services.common.messages import TrainingBatch
from services.learner.noise_scale import b_simple, b_simple_bounds, estimate
from services.learner.samples import Sample, micro_batches, pack


def test_estimates_are_unbiased_on_synthetic_group_gradients():
    rng = np.random.default_rng(0)
    dim, k, reps = 50, 8, 4000
    mu = rng.normal(size=dim) * 0.1
    scale = rng.uniform(0.2, 1.0, size=dim)
    traces, signals = [], []
    for _ in range(reps):
        g = mu + rng.normal(size=(k, dim)) * scale  # one draw per group; the batch's gradient is their mean
        parts = g / k
        total = parts.sum(axis=0)
        m = estimate([float(p @ p) for p in parts], float(total @ total))
        traces.append(m["noise/trace"])
        signals.append(m["noise/signal_sq"])
    true_trace, true_signal = float((scale ** 2).sum()), float(mu @ mu)
    assert np.mean(traces) == pytest.approx(true_trace, rel=0.02)
    assert np.mean(signals) == pytest.approx(true_signal, abs=4 * np.std(signals) / np.sqrt(reps))
    # the naive |G|^2 is biased up by trace / k: what the estimator removes
    assert np.mean(signals) + true_trace / k > 1.5 * true_signal
    assert b_simple([{"noise/trace": t, "noise/signal_sq": s} for t, s in zip(traces, signals)]) == pytest.approx(
        true_trace / true_signal, rel=0.1)


def test_estimate_and_ratio_edge_cases():
    assert estimate([1.0], 1.0) == {"noise/groups": 1.0}  # one group: no spread to measure
    assert np.isnan(b_simple([]))
    assert np.isnan(b_simple([{"noise/trace": 1.0, "noise/signal_sq": -0.5}]))  # the mean is not resolved
    rows = [{"noise/trace": 3.0, "noise/signal_sq": 1.0}, {"noise/trace": 1.0, "noise/signal_sq": -0.5},
            {"grad_norm": 1}]
    assert b_simple(rows) == pytest.approx(2.0 / 0.25)  # ratio of means over the steps that measured


def test_bounds_bracket_the_ratio_and_open_up_when_the_signal_is_unresolved():
    rng = np.random.default_rng(1)
    rows = [{"noise/trace": 10 + rng.normal(), "noise/signal_sq": 0.1 + 0.02 * rng.normal()} for _ in range(30)]
    low, high = b_simple_bounds(rows)
    assert low < b_simple(rows) < high and 70 < low and high < 140
    weak = [{"noise/trace": 10.0, "noise/signal_sq": s} for s in (0.3, -0.2, 0.1, -0.1, 0.05)]
    low, high = b_simple_bounds(weak)
    assert np.isfinite(low) and low > 10 and high == np.inf  # only "at least" can be said
    assert all(np.isnan(b) for b in b_simple_bounds(weak[:1]))


def _batch(sizes: dict[int, list[int]]) -> TrainingBatch:
    """Samples of the given total lengths per group, interleaved across groups (as batches arrive)."""
    samples = []
    for j in range(max(len(v) for v in sizes.values())):
        for g, lengths in sizes.items():
            if j < len(lengths):
                n = lengths[j]
                samples.append(Sample(np.arange(1, n // 2 + 1), np.arange(1, n - n // 2 + 1), group=g))
    return pack(samples)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_by_group_micro_batches_keep_groups_apart(world):
    rng = np.random.default_rng(world)
    tb = _batch({g: [int(x) for x in rng.integers(4, 60, size=int(rng.integers(1, 9)))] for g in (0, 1, 2, 5)})
    plans = [micro_batches(tb, 96, r, world, by_group=True) for r in range(world)]
    assert len({len(p) for p in plans}) == 1, "every rank runs as many micro-batches"
    ends = [[mb.group_end for mb in p] for p in plans]
    assert all(e == ends[0] for e in ends) and sum(ends[0]) == 4 and ends[0][-1]
    seen = [i for p in plans for mb in p for i in mb.samples]
    assert sorted(seen) == list(range(len(tb.group_ids)))
    start = 0
    for j, end in enumerate(ends[0]):  # the rounds since the last group end hold one group, on every rank
        if end:
            group = {int(tb.group_ids[i]) for p in plans for mb in p[start:j + 1] for i in mb.samples}
            assert len(group) == 1
            start = j + 1
    for p in plans:
        for mb in p:
            assert mb.tokens <= 96 or len(mb.samples) <= 1
            if not mb.samples:
                assert not mb.loss_mask.any()  # a filler: no gradient
    # the default plan is unchanged by the option's existence: groups mix, no ends marked
    plain = [micro_batches(tb, 96, r, world) for r in range(world)]
    assert not any(mb.group_end for p in plain for mb in p)
    assert sorted(i for p in plain for mb in p for i in mb.samples) == list(range(len(tb.group_ids)))


def test_by_group_needs_group_ids():
    tb = _batch({0: [8, 9], 1: [7]})
    tb.group_ids = np.zeros(0, np.int32)
    with pytest.raises(ValueError, match="one group id per sample"):
        micro_batches(tb, 64, by_group=True)


def _subset(tb: TrainingBatch, idx: list[int]) -> TrainingBatch:
    cu = tb.cu_seqlens
    take = lambda a: np.concatenate([a[cu[i]:cu[i + 1]] for i in idx])  # noqa: E731
    lengths = [int(cu[i + 1] - cu[i]) for i in idx]
    return TrainingBatch(input_ids=take(tb.input_ids), cu_seqlens=np.r_[0, np.cumsum(lengths)].astype(np.int64),
                         loss_mask=take(tb.loss_mask), advantages=take(tb.advantages),
                         rollout_logprobs=take(tb.rollout_logprobs), mem_mask=take(tb.mem_mask),
                         group_ids=tb.group_ids[idx], policy_version=tb.policy_version, step=tb.step,
                         sample_versions=tb.sample_versions[idx] if len(tb.sample_versions) else tb.sample_versions)


@pytest.mark.slow
def test_worker_measures_each_groups_gradient_and_takes_the_same_step(setup, world):
    from tests.learner.test_shard import worker

    cfg, tb = setup
    groups = sorted(set(tb.group_ids.tolist()))
    assert len(groups) >= 2
    cfg = cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"loss_agg": "seq-mean-token-mean"})})
    steps = {}
    for on in (False, True):
        w = worker(world, cfg, noise_scale=on)
        try:
            steps[on] = (w.train_step(encode(tb)), w.full_state_dict())
        finally:
            w.shutdown()
    (plain, sd0), (measured, sd1) = steps[False], steps[True]
    assert "noise/trace" not in plain and measured["noise/groups"] == len(groups)
    assert measured["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)
    # Only the micro-batches' grouping differs, so the float order of the gradient's sum: Adam's first step
    # (about lr * sign(gradient)) may flip where a gradient is zero to rounding, nowhere else.
    lr = cfg.learner.lr
    diffs = torch.cat([(sd1[k].float() - sd0[k].float()).abs().flatten() for k in sd0 if sd0[k].is_floating_point()])
    assert float((diffs > 1e-5).float().mean()) < 1e-3 and float(diffs.max()) <= 2 * lr + 1e-5

    # Each group alone (lr 1e-12: the weights stay the start's to float precision): its gradient norm,
    # rescaled from its own sample count to the batch's (seq-mean-token-mean), is the group's part of the
    # batch gradient.
    rows = len(tb.group_ids)
    w = worker(world, cfg, lr=1e-12)
    try:
        sq = []
        for g in groups:
            idx = [i for i in range(rows) if tb.group_ids[i] == g]
            sq.append((w.train_step(encode(_subset(tb, idx)))["grad_norm"] * len(idx) / rows) ** 2)
    finally:
        w.shutdown()
    k = len(groups)
    expect = estimate(sq, plain["grad_norm"] ** 2)
    assert measured["noise/trace"] == pytest.approx(expect["noise/trace"], rel=1e-4)
    assert measured["noise/signal_sq"] == pytest.approx(expect["noise/signal_sq"], rel=1e-3,
                                                        abs=1e-4 * expect["noise/trace"] / k)
