"""Confidence intervals for held-out results: percentile bootstrap over prompts.

    lo, hi = bootstrap_ci(em_per_prompt)                   # 95% CI of the mean
    d, lo, hi = paired_bootstrap_diff(em_sft, em_rl)       # mean(rl - sft) and its 95% CI

Paired: both policies answered the same prompts, in the same order, so each resample draws prompt
indices once and applies them to both vectors; the CI is for the mean per-prompt difference. That
is tighter than comparing two independent CIs, and it is the honest test of "RL beat its start".
Resamples use a fixed seed, so a report is reproducible.
"""

from __future__ import annotations

import numpy as np

RESAMPLES = 10_000


def _means(x: np.ndarray, resamples: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(x), size=(resamples, len(x)))
    return x[idx].mean(axis=1)


def bootstrap_ci(values, level: float = 0.95, resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean of ``values`` (nan, nan when empty)."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return float("nan"), float("nan")
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(_means(x, resamples, seed), [tail, 100 - tail])
    return float(lo), float(hi)


def paired_bootstrap_diff(before, after, level: float = 0.95, resamples: int = RESAMPLES,
                          seed: int = 0) -> tuple[float, float, float]:
    """(mean(after - before), CI low, CI high) over paired per-prompt values."""
    a, b = np.asarray(before, dtype=np.float64), np.asarray(after, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired values need the same prompts: {a.shape} vs {b.shape}")
    d = b - a
    if d.size == 0:
        return float("nan"), float("nan"), float("nan")
    lo, hi = bootstrap_ci(d, level, resamples, seed)
    return float(d.mean()), lo, hi
