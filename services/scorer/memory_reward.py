"""The memory reward of one <mem> block (docs/algorithm.md, section 4): pure numpy, no Ray, no model.

Given the log-probs of the gold answer's tokens under the full context and under the memory
context (teacher forcing with the current policy):

    full_keep = full_logp > tau            mem_keep = mem_logp > tau          (mode "independent")
    P_full = exp(sum(full_logp * full_keep) / (sum(full_keep) + eps))
    P_mem  = exp(sum(mem_logp  * mem_keep ) / (sum(mem_keep ) + eps))
    R_mem  = P_mem - P_full

Filter modes: ``independent`` (reference: each side keeps its own confident tokens), ``joint``
(a token counts on both sides only if it passes on both), ``none`` (every answer token counts).
When no token is kept the mean is 0 and P = 1.0 on that side, as in the reference.

    s = memory_reward(full_logp, mem_logp, tau=math.log(0.5), mode="independent")
    s.p_full, s.p_mem, s.r_mem, s.full_keep, s.mem_keep
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

FILTER_MODES = ("independent", "joint", "none")


@dataclass
class BlockReward:
    full_keep: np.ndarray
    mem_keep: np.ndarray
    p_full: float
    p_mem: float

    @property
    def r_mem(self) -> float:
        return self.p_mem - self.p_full


def kept_masks(full_logp: np.ndarray, mem_logp: np.ndarray, tau: float, mode: str) -> tuple[np.ndarray, np.ndarray]:
    if mode not in FILTER_MODES:
        raise ValueError(f"filter mode {mode!r} is not one of {FILTER_MODES}")
    if full_logp.shape != mem_logp.shape:
        raise ValueError(f"answer log-probs differ in shape: full {full_logp.shape}, mem {mem_logp.shape}")
    if mode == "none":
        keep = np.ones(full_logp.shape, dtype=bool)
        return keep, keep.copy()
    full_keep, mem_keep = full_logp > tau, mem_logp > tau
    if mode == "joint":
        both = full_keep & mem_keep
        return both, both.copy()
    return full_keep, mem_keep


def geometric_p(logp: np.ndarray, keep: np.ndarray, eps: float = 1e-8) -> float:
    """exp(mean log-prob of the kept tokens); 1.0 when nothing is kept (reference behaviour)."""
    logp = np.asarray(logp, dtype=np.float64)
    keep = np.asarray(keep, dtype=np.float64)
    return float(math.exp(float((logp * keep).sum()) / (float(keep.sum()) + eps)))


def memory_reward(full_logp, mem_logp, tau: float = math.log(0.5), mode: str = "independent",
                  eps: float = 1e-8) -> BlockReward:
    full_logp = np.asarray(full_logp, dtype=np.float32)
    mem_logp = np.asarray(mem_logp, dtype=np.float32)
    full_keep, mem_keep = kept_masks(full_logp, mem_logp, tau, mode)
    return BlockReward(full_keep, mem_keep, geometric_p(full_logp, full_keep, eps), geometric_p(mem_logp, mem_keep, eps))
