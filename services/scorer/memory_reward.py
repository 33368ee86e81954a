"""The memory reward of one <mem> block (docs/algorithm.md, section 4): pure numpy, no Ray, no model.

Given the log-probs of the gold answer's tokens under the full context and under the memory
context (teacher forcing with the current policy):

    full_keep = full_logp > tau            mem_keep = mem_logp > tau          (mode "independent")
    P_full = exp(sum(full_logp * full_keep) / (sum(full_keep) + eps))
    P_mem  = exp(sum(mem_logp  * mem_keep ) / (sum(mem_keep ) + eps))
    R_mem  = P_mem - P_full

Which tokens count is a filter (``FILTERS``): ``independent`` (reference: each side keeps its own
confident tokens), ``joint`` (a token counts on both sides only if it passes on both), ``none`` (every
answer token counts), ``floor`` (every token counts, its log-prob raised to a floor). How they become
P is an average (``AVERAGES``): ``geometric`` (above, the reference), ``per_question`` (the geometric P
of each question's answer, then their mean), ``arithmetic`` (mean token probability). When no token
is kept the mean is 0 and P = 1.0 on that side, as in the reference.

    s = memory_reward(full_logp, mem_logp, tau=math.log(0.5), mode="independent")
    s = memory_reward(full_logp, mem_logp, mode="none", average="per_question", spans=[(0, 2), (3, 5)])
    s.p_full, s.p_mem, s.r_mem, s.full_keep, s.mem_keep
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

FILTERS = {  # name -> which answer tokens count
    "independent": "each side keeps the tokens it predicts with log-prob above tau (the reference)",
    "joint": "a token counts on both sides only if it passes tau on both",
    "none": "every answer token counts",
    "floor": "every answer token counts, its log-prob raised to at least scorer.logp_floor",
}
AVERAGES = {  # name -> how the counted tokens become P
    "geometric": "P = exp(mean log-prob of the counted tokens), over all questions' answers at once (the reference)",
    "per_question": "the geometric P of each question's answer, then their arithmetic mean: one lost answer of k "
                    "costs about 1/k",
    "arithmetic": "P = mean probability of the counted tokens",
}
FILTER_MODES = tuple(FILTERS)


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
    if mode not in FILTERS:
        raise ValueError(f"filter mode {mode!r} is not one of {FILTER_MODES}")
    if full_logp.shape != mem_logp.shape:
        raise ValueError(f"answer log-probs differ in shape: full {full_logp.shape}, mem {mem_logp.shape}")
    if mode in ("none", "floor"):
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


def average_p(logp: np.ndarray, keep: np.ndarray, average: str = "geometric", spans=None, eps: float = 1e-8) -> float:
    """P of one side under an ``AVERAGES`` rule; ``spans``: each question's [start, end) in the answer
    tokens (None = one question)."""
    if average not in AVERAGES:
        raise ValueError(f"average {average!r} is not one of {tuple(AVERAGES)}")
    logp = np.asarray(logp, dtype=np.float64)
    keep = np.asarray(keep, dtype=bool)
    if average == "geometric":
        return geometric_p(logp, keep, eps)
    if average == "arithmetic":
        return float(np.exp(logp[keep]).mean()) if keep.any() else 1.0
    spans = spans or [(0, len(logp))]
    if any(not 0 <= a < b <= len(logp) for a, b in spans):
        raise ValueError(f"question spans {spans} do not fit {len(logp)} answer tokens")
    return float(np.mean([geometric_p(logp[a:b], keep[a:b], eps) for a, b in spans]))


def memory_reward(full_logp, mem_logp, tau: float = math.log(0.5), mode: str = "independent",
                  eps: float = 1e-8, average: str = "geometric", spans=None, floor: float = -math.inf) -> BlockReward:
    """R_mem of one block from its answer tokens' log-probs under both contexts: ``mode`` (FILTERS)
    says which tokens count, ``average`` (AVERAGES) how they become P, ``spans`` where each question's
    answer lies (for per_question), ``floor`` the lowest log-prob a token contributes in mode floor."""
    full_logp = np.asarray(full_logp, dtype=np.float32)
    mem_logp = np.asarray(mem_logp, dtype=np.float32)
    full_keep, mem_keep = kept_masks(full_logp, mem_logp, tau, mode)
    if mode == "floor":
        full_logp, mem_logp = np.maximum(full_logp, floor), np.maximum(mem_logp, floor)
    return BlockReward(full_keep, mem_keep, average_p(full_logp, full_keep, average, spans, eps),
                       average_p(mem_logp, mem_keep, average, spans, eps))
