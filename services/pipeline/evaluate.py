"""Held-out evaluation: roll out the deployed policy on test prompts, per objective count k.

    prompts = eval_prompts(cfg, per_k=100)                  # {k: [Prompt]}
    table = evaluate(cfg, pipe, prompts, step=0)            # {k: {"em", "f1", "turns", "tt", ...}}

One rollout per prompt at ``eval.temperature`` (0 = greedy), through the same rollout deployment
and driver as training; with ``eval.memory_reward`` the scorer grades every <mem> block too.
Metrics per k (MemPO's evaluation, MEMPO.md section 6):
    em, f1   outcome scores (0 when the episode never answered or broke the grammar)
    turns    assistant turns per episode
    tt       total tokens: sum over turns of (context + generated) tokens
    pt       peak tokens: the largest single-turn context + generation
    r_mem, p_mem, p_full   mean memory reward and its two probabilities over the <mem> blocks
    tool_failures, answered   failed searches per episode, share of episodes that answered
The driver decodes these trajectories itself: evaluation consumes them, it does not forward them.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import ray

from services.common.codec import decode
from services.common.config import MempoConfig
from services.common.data import load_prompts
from services.common.messages import MemoryScoreBatch, Prompt, PromptBatch, TrajectoryBatch
from services.learner.advantages import outcome_reward

METRICS = ("em", "f1", "turns", "tt", "pt", "r_mem", "p_mem", "p_full", "tool_failures", "answered")


def eval_prompts(cfg: MempoConfig, per_k: int) -> dict[int, list[Prompt]]:
    from services.world.build import data_path

    ks = cfg.eval.objectives or cfg.world.test_objectives
    out = {k: load_prompts(data_path(cfg, "test"), k=k, limit=per_k) for k in ks}
    empty = [k for k, v in out.items() if not v]
    if empty:
        raise ValueError(f"no held-out prompts with k in {empty} in {data_path(cfg, 'test')}")
    return out


def evaluate(cfg: MempoConfig, pipe, prompts: dict[int, list[Prompt]], step: int = 0) -> dict[int, dict[str, float]]:
    ordered = [p for k in sorted(prompts) for p in prompts[k]]
    batch = PromptBatch(prompts=ordered, n=1, policy_version=step, step=step, seed=cfg.train.seed + 7919,
                        temperature=cfg.eval.temperature)
    traj_refs = pipe.rollout.rollout(batch)
    score_refs = pipe.scorer.score(traj_refs) if cfg.eval.memory_reward and pipe.scorer is not None else []
    rows: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for i, ref in enumerate(traj_refs):
        traj = decode(ray.get(ref), TrajectoryBatch)
        for group in traj.groups:
            k = len(group.prompt.golds)
            for ep in group.episodes:
                em, f1 = outcome_reward(ep, group.prompt.golds, cfg.algorithm.answer_separator)
                r = rows[k]
                r["em"].append(em)
                r["f1"].append(f1)
                r["turns"].append(len(ep.turns))
                r["tt"].append(ep.total_tokens)
                r["pt"].append(ep.peak_tokens)
                r["tool_failures"].append(ep.tool_failures)
                r["answered"].append(float(ep.answer is not None))
        if score_refs:
            scores = decode(ray.get(score_refs[i]), MemoryScoreBatch)
            for s in scores.scores:
                k = len(traj.groups[s.group].prompt.golds)
                rows[k]["r_mem"].append(s.r_mem)
                rows[k]["p_mem"].append(s.p_mem)
                rows[k]["p_full"].append(s.p_full)
    table = {}
    for k in sorted(rows):
        table[k] = {m: float(np.mean(rows[k][m])) if rows[k][m] else float("nan") for m in METRICS}
        table[k]["episodes"] = float(len(rows[k]["em"]))
    return table


def flatten(table: dict[int, dict[str, float]]) -> dict[str, float]:
    """{"em": mean over k, "k2/em": ..., ...} for the metrics log."""
    out = {f"k{k}/{m}": v for k, row in table.items() for m, v in row.items()}
    for m in METRICS:
        vals = [row[m] for row in table.values() if np.isfinite(row[m])]
        out[m] = float(np.mean(vals)) if vals else float("nan")
    return out
