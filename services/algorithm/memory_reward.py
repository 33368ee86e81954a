"""The memory reward of one <mem> block (docs/algorithm.md, section 4): pure numpy, no Ray, no model.

Given the log-probs of the gold answer's tokens under the full context and under the memory
context (teacher forcing with the current policy):

    full_keep = full_logp > tau            mem_keep = mem_logp > tau          (mode "independent")
    P_full = exp(sum(full_logp * full_keep) / (sum(full_keep) + eps))
    P_mem  = exp(sum(mem_logp  * mem_keep ) / (sum(mem_keep ) + eps))
    R_mem  = P_mem - P_full

Rules are registries: a filter (``FILTERS``, ``@filter_rule``) and an average (``AVERAGES``,
``@average_rule``), each a named function with a one-line description (tables of choices,
services/common/choices.py, whose entries carry their functions); ``scorer.filter_mode`` and
``scorer.average`` accept any registered name (docs/extending.md: adding a rule is one function here
and a test), and tests/algorithm/test_choices.py checks docs/algorithm.md lists them all.
``scorer.scored_answers`` (``SCORED_ANSWERS``) picks which questions' answers are scored.
``python -m services.algorithm.memory_reward`` lists them.

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

from services.common.choices import Choice as Rule  # one named reward rule: name, description, fn
from services.common.choices import Choices

FILTERS = Choices("scorer.filter_mode", "independent")  # which answer tokens count: fn(full_logp, mem_logp, tau, floor)
AVERAGES = Choices("scorer.average", "geometric")  # how the counted tokens become P: fn(logp, keep, spans, eps)
# which questions' answers a block's reward scores (the scorer picks the answer tokens; services/algorithm/retention.py
# says what the observations had shown)
SCORED_ANSWERS = Choices(
    "scorer.scored_answers", "all",
    ("all", "every question's answer (the reference)"),
    ("shown", "only the answers the episode's observations had shown before the block's turn"),
)

# ``fn(full_logp, mem_logp, tau, floor) -> (full_keep, mem_keep, full_logp, mem_logp)`` as
# ``scorer.filter_mode=name`` (the log-probs it returns are what the average sees)
filter_rule = FILTERS.rule
# ``fn(logp, keep, spans, eps) -> P`` as ``scorer.average=name``; ``spans`` are each question's
# [start, end) in the answer tokens (one span covering all of them when k = 1)
average_rule = AVERAGES.rule


@filter_rule("independent", "each side keeps the tokens it predicts with log-prob above tau (the reference)")
def _independent(full_logp, mem_logp, tau, floor):
    return full_logp > tau, mem_logp > tau, full_logp, mem_logp


@filter_rule("joint", "a token counts on both sides only if it passes tau on both")
def _joint(full_logp, mem_logp, tau, floor):
    both = (full_logp > tau) & (mem_logp > tau)
    return both, both.copy(), full_logp, mem_logp


@filter_rule("none", "every answer token counts")
def _none(full_logp, mem_logp, tau, floor):
    keep = np.ones(full_logp.shape, dtype=bool)
    return keep, keep.copy(), full_logp, mem_logp


@filter_rule("floor", "every answer token counts, its log-prob raised to at least scorer.logp_floor")
def _floor(full_logp, mem_logp, tau, floor):
    keep = np.ones(full_logp.shape, dtype=bool)
    return keep, keep.copy(), np.maximum(full_logp, floor), np.maximum(mem_logp, floor)


@dataclass
class BlockReward:
    full_keep: np.ndarray
    mem_keep: np.ndarray
    p_full: float
    p_mem: float

    @property
    def r_mem(self) -> float:
        return self.p_mem - self.p_full


def _rule(rules: Choices, name: str, what: str) -> Rule:
    if name not in rules:
        raise ValueError(f"{what} {name!r} is not one of {tuple(rules)}")
    return rules[name]


def kept_masks(full_logp: np.ndarray, mem_logp: np.ndarray, tau: float, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """Which answer tokens count on each side under filter ``mode``."""
    full_keep, mem_keep, _, _ = _filtered(full_logp, mem_logp, tau, mode, -math.inf)
    return full_keep, mem_keep


def _filtered(full_logp, mem_logp, tau: float, mode: str, floor: float):
    rule = _rule(FILTERS, mode, "filter mode")
    if full_logp.shape != mem_logp.shape:
        raise ValueError(f"answer log-probs differ in shape: full {full_logp.shape}, mem {mem_logp.shape}")
    return rule.fn(full_logp, mem_logp, tau, floor)


def geometric_p(logp: np.ndarray, keep: np.ndarray, eps: float = 1e-8) -> float:
    """exp(mean log-prob of the kept tokens); 1.0 when nothing is kept (reference behaviour)."""
    logp = np.asarray(logp, dtype=np.float64)
    keep = np.asarray(keep, dtype=np.float64)
    return float(math.exp(float((logp * keep).sum()) / (float(keep.sum()) + eps)))


@average_rule("geometric", "P = exp(mean log-prob of the counted tokens), over all questions' answers at once "
                           "(the reference)")
def _geometric(logp, keep, spans, eps):
    return geometric_p(logp, keep, eps)


@average_rule("per_question", "the geometric P of each question's answer, then their arithmetic mean: one lost "
                              "answer of k costs about 1/k")
def _per_question(logp, keep, spans, eps):
    return float(np.mean([geometric_p(logp[a:b], keep[a:b], eps) for a, b in spans]))


@average_rule("min_question", "the lowest geometric P over the questions' answers: one lost answer of k costs "
                              "all of P")
def _min_question(logp, keep, spans, eps):
    return min(geometric_p(logp[a:b], keep[a:b], eps) for a, b in spans)


@average_rule("arithmetic", "P = mean probability of the counted tokens")
def _arithmetic(logp, keep, spans, eps):
    return float(np.exp(logp[keep]).mean()) if keep.any() else 1.0


def average_p(logp: np.ndarray, keep: np.ndarray, average: str = "geometric", spans=None, eps: float = 1e-8) -> float:
    """P of one side under an ``AVERAGES`` rule; ``spans``: each question's [start, end) in the answer
    tokens (None = one question)."""
    rule = _rule(AVERAGES, average, "average")
    logp = np.asarray(logp, dtype=np.float64)
    keep = np.asarray(keep, dtype=bool)
    spans = spans or [(0, len(logp))]
    if any(not 0 <= a < b <= len(logp) for a, b in spans):
        raise ValueError(f"question spans {spans} do not fit {len(logp)} answer tokens")
    return rule.fn(logp, keep, spans, eps)


def memory_reward(full_logp, mem_logp, tau: float = math.log(0.5), mode: str = "independent",
                  eps: float = 1e-8, average: str = "geometric", spans=None, floor: float = -math.inf,
                  questions=None) -> BlockReward:
    """R_mem of one block from its answer tokens' log-probs under both contexts: ``mode`` (FILTERS)
    says which tokens count, ``average`` (AVERAGES) how they become P, ``spans`` where each question's
    answer lies (for per_question), ``floor`` the lowest log-prob a token contributes in mode floor,
    ``questions`` which spans are scored at all (indices into ``spans``; None = every one): the
    others' tokens count on neither side, under any filter and average."""
    full_logp = np.asarray(full_logp, dtype=np.float32)
    mem_logp = np.asarray(mem_logp, dtype=np.float32)
    full_keep, mem_keep, full_logp, mem_logp = _filtered(full_logp, mem_logp, tau, mode, floor)
    if questions is not None:
        spans = spans or [(0, len(full_logp))]
        if not questions or any(not 0 <= q < len(spans) for q in questions):
            raise ValueError(f"questions {list(questions)} do not index the {len(spans)} answer spans")
        spans = [spans[q] for q in sorted(set(questions))]
        scored = np.zeros(full_logp.shape, dtype=bool)
        for a, b in spans:
            scored[a:b] = True
        full_keep, mem_keep = full_keep & scored, mem_keep & scored
        full_logp, mem_logp = np.where(scored, full_logp, 0.0), np.where(scored, mem_logp, 0.0)
    return BlockReward(full_keep, mem_keep, average_p(full_logp, full_keep, average, spans, eps),
                       average_p(mem_logp, mem_keep, average, spans, eps))


if __name__ == "__main__":
    for title, rules in (("scorer.filter_mode", FILTERS), ("scorer.average", AVERAGES)):
        print(title)
        for r in rules.values():
            print(f"  {r.name:14s} {r.description}")
