"""MemPO advantages of one step (docs/algorithm.md, section 5): the outcome reward, then the rules of
outcome.py (A_out) and memory_advantage.py (A_mem), summed into each turn's per-token advantage.

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

from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import numpy as np

from services.algorithm.memory_advantage import MEM_CREDIT_SCOPES, control_rng, permuted, token_advantage
from services.algorithm.outcome import OUTCOME_ADVANTAGES
from services.common.messages import Episode, MemoryScoreBatch, TrajectoryBatch
from services.common.rewards import multi_objective_em, multi_objective_f1

if TYPE_CHECKING:  # the settings section sits above this package; only its fields are read
    from services.learner.settings import AlgorithmConfig


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


def compute_advantages(batch: TrajectoryBatch, scores: Optional[MemoryScoreBatch], cfg: "AlgorithmConfig") -> Advantages:
    """R_out, A_out, A_mem and every turn's per-token advantage of one step's batch (the module doc)."""
    out = Advantages()
    varied = 0  # groups whose outcome rewards differ: the only ones GRPO's outcome advantage learns from
    mem_spreads: list[float] = []  # the std of R_mem in each pool of two or more blocks
    by_group: dict[int, list] = defaultdict(list)
    credit_rule = MEM_CREDIT_SCOPES[MEM_CREDIT_SCOPES.check(cfg.mem_credit_scope)].fn
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
