"""Does a memory still hold what the episode has found? A label-free check of every scored block.

A block *retains* when every gold answer that the episode's observations had shown before its turn
appears in the memory's text (both SQuAD-normalised, services/common/rewards.py); it is unlabelled
(-1) when no gold answer had been shown yet. Text is decoded only to judge, never to train on.
Each training step then reports the share of labelled blocks that retain and the AUC of R_mem for
retaining against losing blocks (0.5 = the reward cannot tell them apart): whether the memory reward
tracks retention in this run, without the oracle's ground truth (bench/memreward.py has that).

    labels = retention_labels(tt, group, blocks)    # 1 retains, 0 lost a shown answer, -1 nothing shown
    retention_metrics([s.r_mem for s in scores], [s.retained for s in scores])
    -> {"retention_blocks": 40.0, "retained_share": 0.85, "retention_auc": 0.74}
"""

from __future__ import annotations

import numpy as np

from services.common.rewards import normalize_answer


def _contains(normalized_text: str, answer: str) -> bool:
    """Whether a SQuAD-normalised text holds ``answer`` as whole words."""
    a = normalize_answer(answer)
    return bool(a) and f" {a} " in f" {normalized_text} "


def retention_labels(tt, group, blocks: list[tuple[int, int]]) -> list[int]:
    """1 / 0 / -1 for each (episode, turn index) block of one RolloutGroup (see the module doc)."""
    golds = [list(g) for g in group.prompt.golds]
    observations: dict[int, list[str]] = {}  # each episode's observations, decoded once
    out = []
    for ei, ti in blocks:
        ep = group.episodes[ei]
        if ei not in observations:
            observations[ei] = [tt.decode(t.observation_ids.tolist())[0] for t in ep.turns]
        seen = normalize_answer(" ".join(observations[ei][:ti]))
        shown = [[a for a in answers if _contains(seen, a)] for answers in golds]
        shown = [s for s in shown if s]
        if not shown:
            out.append(-1)
            continue
        turn = ep.turns[ti]
        memory = normalize_answer(tt.decode(turn.response_ids[turn.mem_start:turn.mem_end].tolist())[0])
        out.append(int(all(any(_contains(memory, a) for a in s) for s in shown)))
    return out


def auc(pos, neg) -> float:
    """P(a positive > a negative) + half the ties; NaN when a side is empty."""
    pos, neg = np.asarray(pos, np.float64)[:, None], np.asarray(neg, np.float64)[None, :]
    if not pos.size or not neg.size:
        return float("nan")
    return float(((pos > neg) + 0.5 * (pos == neg)).mean())


def retention_metrics(r_mem: list[float], retained: list[int]) -> dict[str, float]:
    """The step's retention check over its scored blocks; the AUC only when both classes occur."""
    r, lab = np.asarray(r_mem, np.float64), np.asarray(retained)
    labelled = lab >= 0
    out = {"retention_blocks": float(labelled.sum())}
    if labelled.any():
        out["retained_share"] = float((lab[labelled] == 1).mean())
        a = auc(r[lab == 1], r[lab == 0])
        if not np.isnan(a):
            out["retention_auc"] = a
    return out
