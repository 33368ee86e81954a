"""Held-out evaluation: roll out the deployed policy on test prompts, per objective count k.

    prompts = eval_prompts(cfg, per_k=100)                  # {k: [Prompt]}
    table = evaluate(cfg, pipe, prompts, step=0)            # {k: {"em", "em_lo", "em_hi", "f1", ...}}
    run = run_eval(cfg, pipe, prompts, search=False)        # per-episode rows, blocks, samples

One rollout per prompt at ``eval.temperature`` (0 = greedy), through the same rollout deployment
and driver as training; with ``eval.memory_reward`` the scorer grades every <mem> block too.
``search=False`` is the no-retrieval control: every search returns an empty observation, so EM
there is what the policy recalls without searching (it should be near 0 on the entity-disjoint
held-out set). Metrics per k (MemPO's evaluation, docs/algorithm.md):
    em, f1   outcome scores (0 when the episode never answered or broke the grammar); em_lo/em_hi
             is the 95% bootstrap CI of EM over prompts
    turns    assistant turns per episode
    tt       total tokens: sum over turns of (context + generated) tokens
    pt       peak tokens: the largest single-turn context + generation
    r_mem, p_mem, p_full   mean memory reward and its two probabilities over the <mem> blocks
    tool_failures, answered, well_formed, first_search_hit, answer_seen   (services/pipeline/diagnostics.py)
The driver decodes these trajectories itself: evaluation consumes them, it does not forward them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import ray
from tqdm import tqdm

from services.common.codec import decode
from services.config import MempoConfig
from services.common.data import prompts_per_k
from services.common.messages import MemoryScoreBatch, Prompt, PromptBatch, TrajectoryBatch
from services.common.paths import data_path, model_path
from services.learner.group_samples import decoded_turn, turn_record
from services.pipeline.diagnostics import episode_row
from services.pipeline.stats import bootstrap_ci

EPISODE_METRICS = ("em", "f1", "turns", "tt", "pt", "tool_failures", "answered", "well_formed",
                   "first_search_hit", "answer_seen")
BLOCK_METRICS = ("r_mem", "p_mem", "p_full")
METRICS = EPISODE_METRICS + BLOCK_METRICS
SAMPLES_PER_K = 3  # complete decoded episodes kept per k for samples.md


def eval_prompts(cfg: MempoConfig, per_k: int) -> dict[int, list[Prompt]]:
    return prompts_per_k(data_path(cfg, "test"), cfg.rollout.system_prompt, cfg.eval.objectives, per_k)


@lru_cache(maxsize=4)
def _tokenizer(path: str):
    from transformers import AutoTokenizer  # transformers on use

    return AutoTokenizer.from_pretrained(path)


def decoder(cfg: MempoConfig):
    """``decode(ids) -> text`` with the policy's tokenizer (special tokens left out)."""
    tok = _tokenizer(str(model_path(cfg)))
    return lambda ids: tok.decode(ids, skip_special_tokens=True)


@dataclass
class EvalRun:
    """Everything one evaluation pass produced, per k: episode rows (in prompt order, so two
    policies' rows pair up), memory-block scores and a few decoded episodes."""

    episodes: dict[int, list[dict]] = field(default_factory=lambda: defaultdict(list))
    blocks: dict[int, list[dict]] = field(default_factory=lambda: defaultdict(list))
    samples: dict[int, list[dict]] = field(default_factory=lambda: defaultdict(list))

    def table(self) -> dict[int, dict[str, float]]:
        out = {}
        for k in sorted(self.episodes):
            rows, blocks = self.episodes[k], self.blocks.get(k, [])
            t = {m: _mean([r[m] for r in rows]) for m in EPISODE_METRICS}
            t.update({m: _mean([b[m] for b in blocks]) for m in BLOCK_METRICS})
            t["em_lo"], t["em_hi"] = bootstrap_ci([r["em"] for r in rows])
            t["episodes"] = float(len(rows))
            out[k] = t
        return out

    def em(self, k: int) -> np.ndarray:
        return np.asarray([r["em"] for r in self.episodes[k]], dtype=np.float64)


def _mean(values: list[float]) -> float:
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    return float(v.mean()) if v.size else float("nan")


def run_eval(cfg: MempoConfig, pipe, prompts: dict[int, list[Prompt]], step: int = 0, search: bool = True) -> EvalRun:
    dec = decoder(cfg)
    ordered = [p for k in sorted(prompts) for p in prompts[k]]
    batch = PromptBatch(prompts=ordered, n=1, policy_version=step, step=step, seed=cfg.train.seed + 7919,
                        temperature=cfg.eval.temperature, search=search)
    with tqdm(total=len(pipe.rollout.split(batch)), desc=f"eval step {step}{'' if search else ', search off'}", unit="call",
              leave=False, dynamic_ncols=True) as bar:  # minutes at long horizons: show the calls landing
        traj_refs = pipe.rollout.rollout(batch, on_result=lambda i, ref: bar.update())
    score_refs = pipe.scorer.score(traj_refs) if cfg.eval.memory_reward and pipe.scorer is not None else []
    out = EvalRun()
    for i, ref in enumerate(traj_refs):
        traj = decode(ray.get(ref), TrajectoryBatch)
        scores = decode(ray.get(score_refs[i]), MemoryScoreBatch).scores if score_refs else []
        by_turn = {(s.group, s.episode, s.turn): s for s in scores}
        for s in scores:
            k = len(traj.groups[s.group].prompt.golds)
            out.blocks[k].append({"r_mem": s.r_mem, "p_mem": s.p_mem, "p_full": s.p_full})
        for g, group in enumerate(traj.groups):
            k = len(group.prompt.golds)
            for e, ep in enumerate(group.episodes):
                row = episode_row(ep, group.prompt, dec, cfg.algorithm.answer_separator)
                out.episodes[k].append({"uid": group.prompt.uid, **row})
                if len(out.samples[k]) < SAMPLES_PER_K:
                    out.samples[k].append(_sample(group.prompt, ep, row, dec, by_turn, g, e))
    return out


def _sample(prompt: Prompt, ep, row: dict, dec, by_turn: dict, g: int, e: int) -> dict:
    """A decoded episode for samples.md and `mempo view`: each turn split at its <mem> span, with the
    block's memory score (P's, R_mem, retention, per answer token the log-prob under each context and
    whether the filter counted it)."""
    turns = [{"response": dec(turn.response_ids.tolist()),
              **decoded_turn(turn_record(turn, by_turn.get((g, e, t)), None), dec)} for t, turn in enumerate(ep.turns)]
    return {"uid": prompt.uid, "question": prompt.messages[-1].content, "golds": prompt.golds,
            "answer": ep.answer, "em": row["em"], "finish": ep.finish_reason, "turns": turns}


def evaluate(cfg: MempoConfig, pipe, prompts: dict[int, list[Prompt]], step: int = 0) -> dict[int, dict[str, float]]:
    return run_eval(cfg, pipe, prompts, step).table()


def flatten(table: dict[int, dict[str, float]]) -> dict[str, float]:
    """{"em": mean over k, "k2/em": ..., ...} for the metrics log."""
    out = {f"k{k}/{m}": v for k, row in table.items() for m, v in row.items()}
    for m in METRICS:
        vals = [row[m] for row in table.values() if np.isfinite(row[m])]
        out[m] = float(np.mean(vals)) if vals else float("nan")
    return out
