"""The memory advantage: how the memory rewards of a group's <mem> blocks become A_mem on their tokens
(docs/algorithm.md, section 5). Three choices, each a table of rules registered where the rule is defined:

    algorithm.mem_pooling       which blocks one block's R_mem is normalised against   (MEM_POOLINGS)
    algorithm.mem_credit        what a block's R_mem credits before pooling              (MEM_CREDITS)
    algorithm.mem_credit_scope  where the resulting A_mem lands in the block's tokens    (MEM_CREDIT_SCOPES)

    A_mem   = (R_mem' - mean_pool) / (max(std_pool, floor) + eps)    per pool (algorithm.mem_std_floor)
    A_token = A_out on every generated token of the turn, + alpha * A_mem on its <mem> span

A pooling rule is ``fn(episode, turn index) -> pool key`` (within the prompt's group), a credit rule
``fn(r_mem) -> credited value``, a scope rule ``fn(group scores, group, cfg, spreads, rng) -> {(episode,
turn): [(start, end, A_mem)]}`` (token ranges of the turn's response). Adding one is a function under
``@TABLE.rule(name, description)`` here and a test; the config field accepts it and its help lists it.

    pool_key(episode, 1, "prompt_seen")      # the pool of turn index 1's block
    token_advantage(12, 0.5, (0, 6), a_mem=-1.0, alpha=1.0)
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from typing import Optional

import numpy as np

from services.algorithm.outcome import normalize, spread
from services.common.choices import Choices

MEM_POOLINGS = Choices("algorithm.mem_pooling", "prompt")  # fn(episode, turn index) -> pool key
MEM_CREDITS = Choices("algorithm.mem_credit", "difference")  # fn(r_mem) -> the value a block is credited with
MEM_CREDIT_SCOPES = Choices("algorithm.mem_credit_scope", "block")  # fn(scores, group, cfg, spreads, rng) -> credits


@MEM_POOLINGS.rule("prompt", "every <mem> block of the prompt's group in one pool (the reference)")
def _one_pool(ep, t: int):
    return None


@MEM_POOLINGS.rule("prompt_turn", "one pool per (prompt, turn number)")
def _per_turn(ep, t: int):
    return ep.turns[t].turn


@MEM_POOLINGS.rule("prompt_seen", "one pool per (prompt, the tool responses shown before the block, order ignored)")
def _per_seen(ep, t: int):
    # the token ids of each earlier tool response, order and repeats ignored: two episodes that retrieved the
    # same passages compare their memories
    return frozenset(turn.observation_ids.tobytes() for turn in ep.turns[:t])


def pool_key(ep, t: int, pooling: str):
    """Which pool of its prompt's group the <mem> block of turn index ``t`` joins (``algorithm.mem_pooling``)."""
    return MEM_POOLINGS[MEM_POOLINGS.check(pooling)].fn(ep, t)


@MEM_CREDITS.rule("difference", "R_mem = P_mem - P_full (the reference)")
def _difference(r_mem: float) -> float:
    return r_mem


@MEM_CREDITS.rule("loss_only", "min(P_mem - P_full, 0): a memory is charged for what it lost, never credited beyond "
                               "the full history")
def _loss_only(r_mem: float) -> float:
    return min(r_mem, 0.0)


def mem_credit(r_mem: float, credit: str) -> float:
    """The memory reward one block is credited with (``algorithm.mem_credit``)."""
    return MEM_CREDITS[MEM_CREDITS.check(credit)].fn(r_mem)


def token_advantage(n_tokens: int, a_out: float, mem_span: tuple[int, int], a_mem: float, alpha: float,
                    outcome_on_mem: bool = True, credits: Optional[list[tuple[int, int, float]]] = None) -> np.ndarray:
    """A turn's per-token advantage: ``a_out`` everywhere, plus ``alpha * a_mem`` on ``mem_span``, or,
    when ``credits`` is given (per-question scope), ``alpha * a`` on each of its (start, end, a) ranges."""
    adv = np.full(n_tokens, a_out, dtype=np.float32)
    start, end = mem_span
    if start >= 0 and not outcome_on_mem:
        adv[start:end] = 0.0
    if start >= 0:
        for a, b, value in credits if credits is not None else [(start, end, a_mem)]:
            if value != 0.0:
                adv[a:b] += np.float32(alpha * value)
    return adv


def control_rng(step: int, group: int, uid: str) -> np.random.Generator:
    """The null control's permutations (``algorithm.shuffled_rewards``): fixed by the step, the group and its
    prompt, so a rerun shuffles alike."""
    return np.random.default_rng([int(step), int(group), zlib.crc32(str(uid).encode())])


def permuted(values: list[float], rng: Optional[np.random.Generator]) -> list[float]:
    """``values`` as they are, or (the null control) in ``rng``'s order."""
    return list(values) if rng is None else [float(x) for x in rng.permutation(values)]


def _pooled(pools: dict, cfg, spreads: list[float], rng=None):
    """(member, A_mem) for every member of every pool of (member, R_mem) pairs: R_mem credited by
    ``algorithm.mem_credit``, normalised within its pool; each pool's spread goes to ``spreads``. With
    ``rng`` (the null control) the credited values are permuted within each pool first."""
    for pool in pools.values():
        r_mem = permuted([mem_credit(r, cfg.mem_credit) for _, r in pool], rng)
        if len(pool) >= 2:
            spreads.append(spread(r_mem))
        for (member, _), a in zip(pool, normalize(r_mem, cfg.mem_eps, cfg.mem_std_floor)):
            yield member, float(a)


@MEM_CREDIT_SCOPES.rule("block", "A_mem of the block's R_mem on every token of the block (the reference)")
def _block_credits(group_scores: list, group, cfg, spreads: list[float], rng=None) -> dict:
    """(episode, turn) -> [(mem_start, mem_end, A_mem)] of every scored block of one group: the block's
    R_mem pooled by ``pool_key``, credited on the whole block."""
    pools: dict[object, list] = defaultdict(list)
    for s in group_scores:
        pools[pool_key(group.episodes[s.episode], s.turn, cfg.mem_pooling)].append((s, s.r_mem))
    out = {}
    for s, a in _pooled(pools, cfg, spreads, rng):
        turn = group.episodes[s.episode].turns[s.turn]
        out[(s.episode, s.turn)] = [(turn.mem_start, turn.mem_end, a)]
    return out


@MEM_CREDIT_SCOPES.rule("question", "each question's section of the memory gets the A_mem of that question's own "
                                    "R_mem")
def _question_credits(group_scores: list, group, cfg, spreads: list[float], rng=None) -> dict:
    """(episode, turn) -> [(start, end, A_mem[q])] of every scored block of one group: each question's
    R_mem pooled by (``pool_key``, q), credited on the token range of that question's section (the
    scorer's ``question_spans``; the whole block when the memory has no section for q)."""
    pools: dict[object, list] = defaultdict(list)
    for s in group_scores:
        if not len(s.question_r_mem):
            raise ValueError("algorithm.mem_credit_scope=question needs per-question memory rewards, and the "
                             f"score of group {s.group}, episode {s.episode}, turn {s.turn} has none")
        key = pool_key(group.episodes[s.episode], s.turn, cfg.mem_pooling)
        for q, r in enumerate(s.question_r_mem):
            if np.isfinite(r):
                pools[(key, q)].append(((s, q), float(r)))
    out: dict = defaultdict(list)
    for (s, q), a in _pooled(pools, cfg, spreads, rng):
        turn = group.episodes[s.episode].turns[s.turn]
        start, end = (int(x) for x in s.question_spans[q]) if q < len(s.question_spans) else (-1, -1)
        if start >= 0:  # never outside the block, whatever the scorer sent
            start, end = max(start, turn.mem_start), min(end, turn.mem_end)
        out[(s.episode, s.turn)].append((start, end, a) if 0 <= start < end else (turn.mem_start, turn.mem_end, a))
    return out
