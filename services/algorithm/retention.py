"""Does a memory still hold what the episode has found? A label-free check of every scored block.

A block *retains* when every gold answer that the episode's observations had shown before its turn
appears in the memory's text (both SQuAD-normalised, services/common/rewards.py); it is unlabelled
(-1) when no gold answer had been shown yet. Text is decoded only to judge, never to train on.
With ``scorer.scored_answers=shown`` the same check of the observations (:func:`shown_answers`) also
picks which questions' answers a block's memory reward scores (the labels themselves never train).
Each training step then reports the share of labelled blocks that retain and the AUC of R_mem for
retaining against losing blocks (0.5 = the reward cannot tell them apart): whether the memory reward
tracks retention in this run, without the oracle's ground truth (bench/memreward.py has that).

    shown = shown_answers(tt, group, blocks)        # per block {question: its gold answers shown so far}
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


def shown_answers(tt, group, blocks: list[tuple[int, int]]) -> list[dict[int, list[str]]]:
    """For each (episode, turn index) block of one RolloutGroup: {question index: its gold answers that
    the episode's observations before the block's turn contain}, questions with none left out."""
    golds = [list(g) for g in group.prompt.golds]
    observations: dict[int, list[str]] = {}  # each episode's observations, decoded once
    out = []
    for ei, ti in blocks:
        if ei not in observations:
            observations[ei] = [tt.decode(t.observation_ids.tolist())[0] for t in group.episodes[ei].turns]
        seen = normalize_answer(" ".join(observations[ei][:ti]))
        shown = {q: [a for a in answers if _contains(seen, a)] for q, answers in enumerate(golds)}
        out.append({q: found for q, found in shown.items() if found})
    return out


def retention_labels(tt, group, blocks: list[tuple[int, int]], shown: list[dict] | None = None) -> list[int]:
    """1 / 0 / -1 for each (episode, turn index) block of one RolloutGroup (see the module doc);
    ``shown``: :func:`shown_answers` of the same blocks, when the caller has it already."""
    out = []
    for (ei, ti), found in zip(blocks, shown if shown is not None else shown_answers(tt, group, blocks)):
        if not found:
            out.append(-1)
            continue
        turn = group.episodes[ei].turns[ti]
        memory = normalize_answer(tt.decode(turn.response_ids[turn.mem_start:turn.mem_end].tolist())[0])
        out.append(int(all(any(_contains(memory, a) for a in answers) for answers in found.values())))
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
