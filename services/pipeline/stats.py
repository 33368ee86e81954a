"""Confidence intervals for held-out results: percentile bootstrap over prompts.

    lo, hi = bootstrap_ci(em_per_prompt)                   # 95% CI of the mean
    d, lo, hi = paired_bootstrap_diff(em_sft, em_rl)       # mean(rl - sft) and its 95% CI

Paired: both policies answered the same prompts, in the same order, so each resample draws prompt
indices once and applies them to both vectors; the CI is for the mean per-prompt difference. That
is tighter than comparing two independent CIs, and it is the honest test of "RL beat its start".
Resamples use a fixed seed, so a report is reproducible.

    d, lo, hi = seed_t_interval([d_seed0, d_seed1, d_seed2])   # seeds as the units: Student's t

A bootstrap over prompts says nothing about how far another training seed would move a result; with
three or more seeds, :func:`seed_t_interval` treats each seed's difference as one observation.
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


# Student's t, two-sided 95%: the 0.975 quantile for 1..30 degrees of freedom (standard table values)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (beyond 30: the normal's with two
    Cornish-Fisher terms, within 0.001 of the exact value)."""
    if df < 1:
        raise ValueError(f"t needs at least 1 degree of freedom, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def seed_t_interval(values) -> tuple[float, float, float]:
    """(mean, 95% CI low, high) of per-seed values (one per training seed), by Student's t with n - 1
    degrees of freedom; nan bounds with fewer than two values."""
    x = np.asarray(values, dtype=np.float64)
    if x.size < 2:
        m = float(x.mean()) if x.size else float("nan")
        return m, float("nan"), float("nan")
    half = t975(x.size - 1) * x.std(ddof=1) / np.sqrt(x.size)
    return float(x.mean()), float(x.mean() - half), float(x.mean() + half)
