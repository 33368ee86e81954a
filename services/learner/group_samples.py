"""A bounded sample of each step's training groups, for ``mempo view``: every episode of a prompt
with its outcome reward and advantage, and every turn's memory block with its memory score and A_mem.

The learner is the one stage that holds a step's trajectories, memory scores and advantages
together, so it cuts the sample (token ids, spans from token positions) and returns it with the
step's metrics; the driver decodes it and appends one JSON line per group to
``<run_dir>/groups.jsonl`` (services/pipeline/train.py). ``train.sample_groups`` caps it per step.

    records = group_records(traj, scores, adv, limit=2)   # plain lists and numbers, no text
    rows = [decoded_group(r, tokenizer.decode) for r in records]
    decoded_turn(turn_record(turn, score, None), decode)  # one turn (the eval's samples use it too)
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from services.common.messages import MemoryScore, MemoryScoreBatch, TrajectoryBatch, TurnRecord
from services.algorithm.advantages import Advantages


def _score(s) -> dict:
    return {"p_mem": float(s.p_mem), "p_full": float(s.p_full), "r_mem": float(s.r_mem), "retained": int(s.retained),
            "answer_ids": [int(i) for i in s.answer_ids], "mem_logp": [float(x) for x in s.mem_logp],
            "full_logp": [float(x) for x in s.full_logp], "mem_keep": [bool(x) for x in s.mem_keep],
            "full_keep": [bool(x) for x in s.full_keep],
            "question_r_mem": [float(x) if np.isfinite(x) else None for x in s.question_r_mem],
            "question_spans": [[int(a), int(b)] for a, b in s.question_spans]}


def turn_record(turn: TurnRecord, score: Optional[MemoryScore], a_mem: Optional[float]) -> dict:
    """One turn as plain data: its response ids split at its own ``<mem>`` span (before the block,
    the block, after it), the observation, and the block's memory score and A_mem when it has them."""
    ids = [int(i) for i in turn.response_ids]
    start, end = (turn.mem_start, turn.mem_end) if turn.mem_start >= 0 else (0, 0)
    return {"turn": int(turn.turn), "before_ids": ids[:start], "mem_ids": ids[start:end], "after_ids": ids[end:],
            "observation_ids": [int(i) for i in turn.observation_ids], "action": turn.action,
            "problems": list(turn.problems), "a_mem": a_mem, "score": None if score is None else _score(score)}


def decoded_turn(t: dict, decode: Callable[[list[int]], str]) -> dict:
    """A :func:`turn_record` with text in place of ids (the answer tokens one by one, for the heat map)."""
    score = t["score"]
    if score is not None:
        score = {k: v for k, v in score.items() if k != "answer_ids"}
        score["tokens"] = [decode([i]) for i in t["score"]["answer_ids"]]
    return {"turn": t["turn"], "before": decode(t["before_ids"]), "mem": decode(t["mem_ids"]),
            "after": decode(t["after_ids"]), "observation": decode(t["observation_ids"]), "action": t["action"],
            "problems": t["problems"], "a_mem": t["a_mem"], "memory_reward": score}


def group_records(traj: TrajectoryBatch, scores: Optional[MemoryScoreBatch], adv: Advantages,
                  limit: int) -> list[dict]:
    """The first ``limit`` groups of ``traj`` as plain records (every turn a :func:`turn_record`)."""
    if limit <= 0:
        return []
    by_turn = {(s.group, s.episode, s.turn): s for s in (scores.scores if scores is not None else [])}
    out = []
    for g, group in enumerate(traj.groups[:limit]):
        episodes = []
        for e, ep in enumerate(group.episodes):
            turns = [turn_record(turn, by_turn.get((g, e, t)), adv.a_mem.get((g, e, t)))
                     for t, turn in enumerate(ep.turns)]
            episodes.append({"sample": int(ep.sample), "answer": ep.answer, "finish": ep.finish_reason,
                             "reward": adv.rewards.get((g, e)), "f1": adv.f1.get((g, e)),
                             "a_out": adv.a_out.get((g, e)), "peak_tokens": int(ep.peak_tokens),
                             "total_tokens": int(ep.total_tokens), "turns": turns})
        out.append({"uid": group.prompt.uid, "question": group.prompt.messages[-1].content,
                    "golds": [list(g) for g in group.prompt.golds], "k": len(group.prompt.golds),
                    "episodes": episodes})
    return out


def decoded_group(record: dict, decode: Callable[[list[int]], str]) -> dict:
    """``record`` with text in place of token ids (every turn a :func:`decoded_turn`)."""
    episodes = [{**{k: v for k, v in ep.items() if k != "turns"}, "turns": [decoded_turn(t, decode) for t in ep["turns"]]}
                for ep in record["episodes"]]
    return {**{k: v for k, v in record.items() if k != "episodes"}, "episodes": episodes}
