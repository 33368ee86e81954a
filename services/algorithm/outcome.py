"""The outcome advantage: how a GRPO group's rewards become each episode's A_out
(``algorithm.outcome_advantage``; docs/algorithm.md, section 5).

A rule is one function under ``@outcome_rule(name, description)`` taking the group's rewards and
``algorithm.grpo_eps`` and returning one float32 advantage per episode; the config field accepts every
registered name and its help lists them. A group whose rewards are all equal (or a single episode)
gets 0 under every rule, never NaN.

    a_out = OUTCOME_ADVANTAGES["grpo"].fn([1.0, 0.0, 0.0, 1.0], 1e-6)
"""

from __future__ import annotations

import numpy as np

from services.common.choices import Choices

OUTCOME_ADVANTAGES = Choices("algorithm.outcome_advantage", "grpo")  # fn(rewards, eps) -> float32 array


# ``fn(rewards, eps) -> advantages`` as ``algorithm.outcome_advantage=name``
outcome_rule = OUTCOME_ADVANTAGES.rule


def spread(values) -> float:
    """The unbiased std of a set (0 for fewer than two values)."""
    v = np.asarray(values, dtype=np.float64)
    return float(v.std(ddof=1)) if v.size >= 2 else 0.0


def normalize(values, eps: float, std_floor: float = 0.0) -> np.ndarray:
    """(v - mean) / (max(std, std_floor) + eps) with the unbiased std; 0 for a single or constant set.
    A floor keeps a set whose values barely differ (noise) from being blown up to unit scale."""
    v = np.asarray(values, dtype=np.float64)
    std = spread(v)
    if not np.isfinite(std) or std == 0.0:  # also a single value: spread() is 0 for it
        return np.zeros(v.shape, np.float32)
    return ((v - v.mean()) / (max(std, std_floor) + eps)).astype(np.float32)


@outcome_rule("grpo", "(R - mean) / (std + eps) within the group, the unbiased std (GRPO, the reference)")
def grpo(rewards, eps: float) -> np.ndarray:
    return normalize(rewards, eps)


@outcome_rule("dr_grpo", "R - mean within the group, no division by its std (Dr. GRPO's advantage: a group "
                         "whose rewards barely differ is not scaled up to unit size)")
def dr_grpo(rewards, eps: float) -> np.ndarray:
    v = np.asarray(rewards, dtype=np.float64)
    if spread(v) == 0.0:  # also a single reward
        return np.zeros(v.shape, np.float32)
    return (v - v.mean()).astype(np.float32)
