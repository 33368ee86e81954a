"""The gradient noise scale of an RL step, measured over its prompt groups (learner.noise_scale).

McCandlish et al. (2018, "An Empirical Model of Large-Batch Training") call B_simple = tr(S) / |G|^2
the noise scale: S the covariance of one unit's gradient, G its mean. With batches much smaller than
it, an update is mostly noise, the best learning rate grows about in proportion to the batch, and the
number of samples a given progress needs hardly depends on how they are split into steps; with
batches much larger, more of them per step buys nothing.

Here the unit is the prompt group (GRPO's independent draw: one prompt, its n rollouts, their shared
baseline). The worker builds micro-batches that never mix groups (services/learner/samples.py,
``by_group``) and, after each group's last micro-batch, takes the gradient that group added, G_k
(the batch's gradient is G = sum_k G_k, the loss's own normalisation). With K groups, g_k = K G_k
are K draws whose mean is G, so

    tr(S) ~= (K^2 sum_k |G_k|^2 - K |G|^2) / (K - 1)      |G_true|^2 ~= |G|^2 - tr(S) / K

both unbiased; their ratio in one step is noisy (the second can come out negative), so a run's
figure is the ratio of their means over steps (``b_simple``). Plain gradients, not Adam's
preconditioned ones; the KL term included (it is part of the update).

    tracker = GroupGradients(params)       # before the first micro-batch's backward
    ... backward ...; tracker.close_group()   # after each micro-batch with group_end
    metrics = tracker.finish()             # before clipping: noise/trace, noise/signal_sq, noise/groups
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist


def estimate(group_sq: list[float], total_sq: float) -> dict:
    """The unbiased trace of one group's gradient covariance and squared norm of the mean gradient, from
    the groups' squared gradient norms (|G_k|^2, parts of the batch's gradient) and the batch's |G|^2."""
    k = len(group_sq)
    if k < 2:
        return {"noise/groups": float(k)}
    trace = (k * k * sum(group_sq) - k * total_sq) / (k - 1)
    return {"noise/groups": float(k), "noise/trace": trace, "noise/signal_sq": total_sq - trace / k}


def _pairs(rows: list[dict]) -> np.ndarray:
    """[steps, 2]: (trace, signal) of the rows that measured both."""
    return np.array([(r["noise/trace"], r["noise/signal_sq"]) for r in rows
                     if "noise/trace" in r and "noise/signal_sq" in r], dtype=np.float64).reshape(-1, 2)


def _ratio(trace, signal):
    """Mean trace over mean signal; inf where the signal is not positive (unresolved)."""
    return np.where(signal > 0, trace / np.where(signal > 0, signal, 1.0), np.inf)


def b_simple(rows: list[dict]) -> float:
    """A run's noise scale in prompt groups: mean trace over mean signal of the steps that have both
    (NaN if the mean signal is not positive: the gradient's mean is not resolved at these batches)."""
    pairs = _pairs(rows)
    if not len(pairs):
        return float("nan")
    ratio = float(_ratio(pairs[:, 0].mean(), pairs[:, 1].mean()))
    return ratio if np.isfinite(ratio) else float("nan")


def b_simple_bounds(rows: list[dict], level: float = 0.9, draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A percentile bootstrap over steps of ``b_simple`` (two-sided ``level``): (low, high), high = inf
    where resampled steps leave the mean signal unresolved (not positive). The low end is what a run can
    say when the signal is small: the noise scale is at least that."""
    pairs = _pairs(rows)
    if len(pairs) < 2:
        return float("nan"), float("nan")
    idx = np.random.default_rng(seed).integers(0, len(pairs), size=(draws, len(pairs)))
    ratio = _ratio(pairs[idx, 0].mean(axis=1), pairs[idx, 1].mean(axis=1))
    tail = (1.0 - level) / 2
    pick = (lambda q: float(np.quantile(ratio, q, method="inverted_cdf")))  # no interpolation: inf stays inf
    return pick(tail), pick(1.0 - tail)


def _local(grad: torch.Tensor) -> torch.Tensor:
    return (grad.to_local() if hasattr(grad, "to_local") else grad).detach()


class GroupGradients:
    """Squared norms of the gradient each prompt group adds, over every rank's shard of the parameters
    (a sum of local squares, all-reduced: collective, so every rank calls it at the same points)."""

    def __init__(self, params):
        self.params = [p for p in params if p.requires_grad]
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.prev = [None] * len(self.params)
        self.group_sq: list[float] = []

    def _sq(self, parts) -> float:
        """The squared norm over all ranks, summed where the gradients live (one host sync; NCCL reduces
        device tensors only)."""
        sq = [t.double().pow(2).sum() for t in parts if t is not None]
        total = torch.stack(sq).sum() if sq else torch.zeros((), dtype=torch.float64, device=self.device)
        if dist.is_initialized():
            dist.all_reduce(total)
        return float(total)

    def close_group(self) -> None:
        """The gradient accumulated since the last group closed is one group's: record its squared norm
        (a parameter's gradient, once set, stays set until the step's zero_grad)."""
        now = [None if p.grad is None else _local(p.grad) for p in self.params]
        deltas = [n if b is None or n is None else n - b for n, b in zip(now, self.prev)]
        self.group_sq.append(self._sq(deltas))
        self.prev = [None if n is None else n.clone() for n in now]

    def finish(self) -> dict:
        """The step's estimates (call after the last backward, before the gradient is clipped)."""
        total = self._sq([None if p.grad is None else _local(p.grad) for p in self.params])
        return estimate(self.group_sq, total)
