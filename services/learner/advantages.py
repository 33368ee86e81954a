"""MemPO advantages (docs/algorithm.md, section 5): outcome reward, GRPO, memory advantage, per-token sum.

    R_out   = EM of the last <answer> (SQuAD-normalised, fraction of the k questions); 0 if the
              episode's format is invalid (it never answered, or a turn broke the grammar)
    A_out   = (R_out - mean_group) / (std_group + eps)                       per episode
              (algorithm.outcome_advantage: grpo; dr_grpo leaves out the std, services/algorithm/outcome.py)
    R_mem'  = R_mem, or min(R_mem, 0) with algorithm.mem_credit=loss_only (a memory charged only for
              what it lost against the full history)
    A_mem   = (R_mem' - mean_pool) / (max(std_pool, floor) + eps)            per <mem> block, pooled
              over the prompt's group ("prompt", reference), per (prompt, turn) ("prompt_turn"), or
              per (prompt, the observations the episode had seen before this turn) ("prompt_seen":
              memories compared only with memories written after the same search results);
              floor = algorithm.mem_std_floor (0 in the reference: plain normalisation)
    A_token = A_out on every generated token of the episode, + alpha * A_mem on the tokens of that
              turn's <mem>...</mem> span; observation tokens get no loss

With ``algorithm.mem_credit_scope=question`` the memory advantage is per question instead: each
question q a block scores has its own R_mem[q] (the scorer's ``question_r_mem``), pooled as above but
per (pool, q), and alpha * A_mem[q] lands on the tokens of the memory's ``Q<q>:`` section only (the
scorer's ``question_spans``; on the whole block when the memory has no section for q). Tokens outside
every section (the tags) get no memory advantage; ``a_mem`` of the block logs the mean of its A_mem[q].

``algorithm.shuffled_rewards`` (a null control) permutes each group's R_out and each pool's R_mem among
their members before the normalisation: the same advantage values, landed on the wrong episodes.

std is the unbiased sample std (as torch.std in verl). A group or pool whose values are all equal,
or that holds a single value, gets advantage 0, never NaN.

    adv = compute_advantages(trajectory_batch, memory_score_batch, cfg.algorithm)
    adv.token_advantages[(g, e, t)]   # float32 array over turn t's response tokens
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from services.algorithm.outcome import OUTCOME_ADVANTAGES, normalize, spread
from services.common.choices import MEM_CREDIT_SCOPES, MEM_CREDITS, MEM_POOLINGS
from services.config import AlgorithmConfig
from services.common.messages import Episode, MemoryScoreBatch, TrajectoryBatch
from services.common.rewards import multi_objective_em, multi_objective_f1


def format_valid(ep: Episode) -> bool:
    """The episode ended with an answer and every turn followed the grammar."""
    return ep.answer is not None and ep.finish_reason == "answer" and all(t.format_ok for t in ep.turns)


def outcome_reward(ep: Episode, golds: list[list[str]], separator: str = ";") -> tuple[float, float]:
    """(R_out, F1); both 0 when the format is invalid."""
    if not format_valid(ep):
        return 0.0, 0.0
    return multi_objective_em(ep.answer, golds, separator), multi_objective_f1(ep.answer, golds, separator)


@dataclass
class Advantages:
    rewards: dict[tuple[int, int], float] = field(default_factory=dict)  # (group, episode) -> R_out
    f1: dict[tuple[int, int], float] = field(default_factory=dict)
    a_out: dict[tuple[int, int], float] = field(default_factory=dict)
    a_mem: dict[tuple[int, int, int], float] = field(default_factory=dict)  # (group, episode, turn) -> A_mem
    token_advantages: dict[tuple[int, int, int], np.ndarray] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


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


def pool_key(ep: Episode, t: int, pooling: str):
    """Which pool of its prompt's group the <mem> block of turn index ``t`` joins: one pool for the
    group ("prompt"), one per turn number ("prompt_turn"), or one per set of observations the episode
    had been shown before the block ("prompt_seen": the token ids of each earlier tool response, order
    and repeats ignored, so two episodes that retrieved the same passages compare their memories)."""
    if pooling == "prompt":
        return None
    if pooling == "prompt_turn":
        return ep.turns[t].turn
    if pooling == "prompt_seen":
        return frozenset(turn.observation_ids.tobytes() for turn in ep.turns[:t])
    raise MEM_POOLINGS.unknown(pooling)


def mem_credit(r_mem: float, credit: str) -> float:
    """The memory reward one block is credited with (``algorithm.mem_credit``)."""
    if credit == "difference":
        return r_mem
    if credit == "loss_only":
        return min(r_mem, 0.0)
    raise MEM_CREDITS.unknown(credit)


def _pooled(pools: dict, cfg: AlgorithmConfig, spreads: list[float], rng=None):
    """(member, A_mem) for every member of every pool of (member, R_mem) pairs: R_mem credited by
    ``algorithm.mem_credit``, normalised within its pool; each pool's spread goes to ``spreads``. With
    ``rng`` (the null control) the credited values are permuted within each pool first."""
    for pool in pools.values():
        r_mem = permuted([mem_credit(r, cfg.mem_credit) for _, r in pool], rng)
        if len(pool) >= 2:
            spreads.append(spread(r_mem))
        for (member, _), a in zip(pool, normalize(r_mem, cfg.mem_eps, cfg.mem_std_floor)):
            yield member, float(a)


def _block_credits(group_scores: list, group, cfg: AlgorithmConfig, spreads: list[float], rng=None) -> dict:
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


def _question_credits(group_scores: list, group, cfg: AlgorithmConfig, spreads: list[float], rng=None) -> dict:
    """(episode, turn) -> [(start, end, A_mem[q])] of every scored block of one group: each question's
    R_mem pooled by (``pool_key``, q), credited on the token range of that question's section."""
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


def control_rng(step: int, group: int, uid: str) -> np.random.Generator:
    """The null control's permutations (``algorithm.shuffled_rewards``): fixed by the step, the group and its
    prompt, so a rerun shuffles alike."""
    return np.random.default_rng([int(step), int(group), zlib.crc32(str(uid).encode())])


def permuted(values: list[float], rng: Optional[np.random.Generator]) -> list[float]:
    """``values`` as they are, or (the null control) in ``rng``'s order."""
    return list(values) if rng is None else [float(x) for x in rng.permutation(values)]


# algorithm.mem_credit_scope -> the credit rule: one entry per MEM_CREDIT_SCOPES choice (a test checks)
CREDIT_SCOPES = {"block": _block_credits, "question": _question_credits}


def compute_advantages(batch: TrajectoryBatch, scores: Optional[MemoryScoreBatch], cfg: AlgorithmConfig) -> Advantages:
    out = Advantages()
    varied = 0  # groups whose outcome rewards differ: the only ones GRPO's outcome advantage learns from
    mem_spreads: list[float] = []  # the std of R_mem in each pool of two or more blocks
    by_group: dict[int, list] = defaultdict(list)
    credit_rule = CREDIT_SCOPES[MEM_CREDIT_SCOPES.check(cfg.mem_credit_scope)]
    outcome_rule = OUTCOME_ADVANTAGES[OUTCOME_ADVANTAGES.check(cfg.outcome_advantage)].fn
    if scores is not None and cfg.use_memory_reward:
        for s in scores.scores:
            by_group[s.group].append(s)
    for g, group in enumerate(batch.groups):
        rs = [outcome_reward(ep, group.prompt.golds, cfg.answer_separator) for ep in group.episodes]
        rng = control_rng(batch.step, g, group.prompt.uid) if cfg.shuffled_rewards else None
        values = permuted([r for r, _ in rs], rng)
        a_out = outcome_rule(values, cfg.grpo_eps)
        varied += len(set(values)) > 1
        for e, ((r, f1), a) in enumerate(zip(rs, a_out)):
            out.rewards[(g, e)], out.f1[(g, e)], out.a_out[(g, e)] = r, f1, float(a)
        credits = credit_rule(by_group.get(g, []), group, cfg, mem_spreads, rng)  # (e, t) -> [(start, end, A_mem)]
        for (e, t), c in credits.items():
            out.a_mem[(g, e, t)] = float(np.mean([a for _, _, a in c]))  # per question: the mean, for the log
        for e, ep in enumerate(group.episodes):
            for t, turn in enumerate(ep.turns):
                out.token_advantages[(g, e, t)] = token_advantage(
                    len(turn.response_ids), out.a_out[(g, e)], (turn.mem_start, turn.mem_end),
                    out.a_mem.get((g, e, t), 0.0), cfg.mem_alpha, cfg.outcome_on_mem, credits.get((e, t), []))
    n = max(1, len(out.rewards))
    out.metrics = {"reward_mean": sum(out.rewards.values()) / n, "f1_mean": sum(out.f1.values()) / n,
                   "format_ok_share": sum(format_valid(ep) for grp in batch.groups for ep in grp.episodes) / n,
                   "mem_blocks": float(len(out.a_mem)),
                   # how far apart a pool's memory rewards are, and how large the advantages made of them
                   "mem_pools": float(len(mem_spreads)),
                   "mem_pool_std_mean": float(np.mean(mem_spreads)) if mem_spreads else 0.0,
                   "mem_pool_std_max": float(np.max(mem_spreads)) if mem_spreads else 0.0,
                   "mem_adv_abs_mean": float(np.mean(np.abs(list(out.a_mem.values())))) if out.a_mem else 0.0,
                   "groups_with_variance": varied / max(1, len(batch.groups))}
    return out
