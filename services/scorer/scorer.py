"""Memory scoring of rollouts with the current policy (no Ray: the service wraps this).

For every <mem> block of turn t >= 2 (turn 1 has no history to compress, as in the reference):

    full context = episode.full_ids[:turn.full_prefix_len]                 (the uncompressed history)
    mem context  = episode.prompt_ids + turn.response_ids[mem_start:mem_end]   (system + question + memory)
    continuation = scorer.answer_template with the group's gold answer     (same for both)

Both are scored with prefix sharing (``packing.tree_logprobs``): one tree per episode for the full
contexts (each block's continuation hangs off its prefix of the full history) and one tree per
group for the mem contexts (every memory block hangs off the shared prompt).

    scorer = MemoryScorer(model, tokenizer, cfg)
    scores = scorer.score_trajectories(trajectory_batch, version=3)   # -> MemoryScoreBatch

A group whose gold answer cannot be turned into a continuation (empty, or text the tokenizer does
not decode back even after NFC normalisation) is skipped, counted in ``metrics["golds_skipped"]``;
it never fails the batch (its episodes then get no memory reward, like a group without blocks).

Each score also carries, per question of the prompt, that question's own R_mem (its answer span
alone, under the same rule) and the token range of the memory's section on it (``Q<i>: ...``,
:func:`section_spans`): what ``algorithm.mem_credit_scope=question`` credits section by section.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from services.config import MempoConfig, ScorerConfig, fields_marked
from services.algorithm.memory_reward import SCORED_ANSWERS, memory_reward
from services.algorithm.sections import memory_sections
from services.common.messages import MemoryScore, MemoryScoreBatch, TrajectoryBatch
from services.common.model_io import chat_ids, text_ids
from services.algorithm.retention import retention_labels, shown_answers
from services.common.token_text import TokenText
from services.common.turn_format import block
from services.scorer.continuation import Continuation, build_continuation, gold_answers
from services.scorer.packing import Branch, tree_logprobs

log = logging.getLogger("mempo.scorer")

RULE_FIELDS = fields_marked(ScorerConfig, "rule")  # the reward's rule: every score echoes these


def text_contexts(tokenizer, system: str, questions: list[str], memory: str,
                  history: list[dict]) -> tuple[list[int], list[int]]:
    """(mem context, full context) ids for grading a memory given as text: system + question(s)
    + ``<mem>`` block, versus system + question(s) + the full chat history. Every text is user text:
    special-token strings in it stay ordinary text (services/common/model_io.py)."""
    head = [{"role": "system", "content": system}, {"role": "user", "content": "; ".join(questions)}]
    mem = chat_ids(tokenizer, head) + text_ids(tokenizer, block("mem", memory))
    return mem, chat_ids(tokenizer, head + list(history))


def section_spans(tt: TokenText, response_ids, mem_start: int, mem_end: int, k: int) -> np.ndarray:
    """(k, 2) token ranges [start, end) in ``response_ids`` of the memory's section on each question
    (``Q<i>:`` up to the next header or ``</mem>``; -1, -1 where the memory has no section for it; a
    question named twice keeps its first section). Found in the decoded text, mapped back to token positions: a
    token that straddles a boundary belongs to the section that begins in it."""
    out = np.full((k, 2), -1, np.int32)
    text, ends = tt.decode(response_ids[mem_start:mem_end])
    found = memory_sections(text)
    if not found:
        return out
    starts = [tt.token_span(text, ends, a, b)[0] for _, a, b in found]  # the token each header begins in
    stops = starts[1:] + [tt.token_span(text, ends, found[-1][1], found[-1][2])[1]]  # disjoint: up to the next header
    for (q, _, _), ts, te in zip(found, starts, stops):
        if 0 <= q < k and out[q, 0] < 0:
            out[q] = (mem_start + ts, mem_start + te)
    return out


def scored_blocks(group) -> list[tuple[int, int]]:
    """(episode, turn) of every <mem> block a group's memory reward scores: a turn >= 2 (turn 1 has no
    history to compress, as in the reference), in episode then turn order."""
    return [(ei, ti) for ei, ep in enumerate(group.episodes) for ti, t in enumerate(ep.turns)
            if t.mem_start >= 0 and t.turn >= 2]


class MemoryScorer:
    def __init__(self, model, tokenizer, cfg: MempoConfig):
        self.model = model
        self.tokenizer = tokenizer
        self.cfg = cfg.scorer
        self.tt = TokenText(tokenizer)

    def continuation(self, gold: str | list[str]) -> Continuation:
        """The scored continuation of a gold answer (one per question: each keeps its own span)."""
        return build_continuation(self.tokenizer, self.cfg.answer_template, gold, self.tt, self.cfg.gold_joiner)

    def reward(self, full_lp: np.ndarray, mem_lp: np.ndarray, cont: Continuation, questions=None):
        c = self.cfg
        return memory_reward(full_lp, mem_lp, c.tau, c.filter_mode, c.mean_eps, c.average, cont.question_spans(),
                             c.logp_floor, questions)

    def score_trajectories(self, batch: TrajectoryBatch, version: int) -> MemoryScoreBatch:
        """Every scored block of the batch (:func:`scored_blocks`), group by group: the answer after
        each block's full history (one tree per episode), after its memory (one tree per group), then
        the block's rewards, over all its questions and per question."""
        t0 = time.perf_counter()
        stats: dict = {}
        scores: list[MemoryScore] = []
        skipped = unshown = 0
        for gi, group in enumerate(batch.groups):
            try:
                cont = self.continuation(gold_answers(group.prompt.golds))
            except ValueError as e:
                skipped += 1
                log.warning("group %d skipped: no answer continuation for its gold (%s)", gi, e)
                continue
            blocks = scored_blocks(group)
            if not blocks:
                continue
            full_lp = self.full_context_logprobs(group, blocks, cont, stats)
            mem_lp = self.memory_logprobs(gi, group, blocks, cont, stats)
            group_scores, group_unshown = self.block_scores(gi, group, blocks, cont, full_lp, mem_lp)
            scores += group_scores
            unshown += group_unshown
        n = max(1, len(scores))
        metrics = {"blocks": float(len(scores)), "golds_skipped": float(skipped), "blocks_unshown": float(unshown),
                   "forwards": float(stats.get("forwards", 0)),
                   "model_tokens": float(stats.get("tokens", 0)), "seconds": time.perf_counter() - t0,
                   "p_mem_mean": sum(s.p_mem for s in scores) / n, "p_full_mean": sum(s.p_full for s in scores) / n,
                   "r_mem_mean": sum(s.r_mem for s in scores) / n}
        return MemoryScoreBatch(scores=scores, policy_version=version, step=batch.step, metrics=metrics,
                                **self.rule())

    def full_context_logprobs(self, group, blocks: list[tuple[int, int]], cont: Continuation,
                              stats: dict) -> dict[tuple[int, int], np.ndarray]:
        """The answer's log-probs after each block's full context, by (episode, turn): one tree per
        episode, each block's continuation hanging off its prefix of the episode's full history."""
        a0, a1 = cont.answer_start, cont.answer_end
        full_lp: dict[tuple[int, int], np.ndarray] = {}
        for ei, ep in enumerate(group.episodes):
            mine = [ti for e, ti in blocks if e == ei]
            if not mine:
                continue
            branches = [Branch(int(ep.turns[ti].full_prefix_len), cont.ids) for ti in mine]
            for ti, lp in zip(mine, tree_logprobs(self.model, ep.full_ids.tolist(), branches,
                                                  self.cfg.token_budget, stats)):
                full_lp[(ei, ti)] = lp[a0:a1]
        return full_lp

    def memory_logprobs(self, gi: int, group, blocks: list[tuple[int, int]], cont: Continuation,
                        stats: dict) -> list[np.ndarray]:
        """The answer's log-probs after each block's mem context, in ``blocks`` order: one tree per
        group, every memory hanging off the system + question prompt its episodes share."""
        first = group.episodes[blocks[0][0]].prompt_ids
        if any(not np.array_equal(group.episodes[ei].prompt_ids, first) for ei in {e for e, _ in blocks}):
            raise ValueError(f"group {gi}: episodes of one prompt have different prompt_ids")
        prompt = first.tolist()
        mems = []
        for ei, ti in blocks:
            t = group.episodes[ei].turns[ti]
            mems.append(t.response_ids[t.mem_start:t.mem_end].tolist())
        branches = [Branch(len(prompt), m + cont.ids) for m in mems]
        mem_lps = tree_logprobs(self.model, prompt, branches, self.cfg.token_budget, stats)
        a0, a1 = cont.answer_start, cont.answer_end
        return [lp[len(m) + a0:len(m) + a1] for m, lp in zip(mems, mem_lps)]

    def block_scores(self, gi: int, group, blocks: list[tuple[int, int]], cont: Continuation,
                     full_lp: dict[tuple[int, int], np.ndarray], mem_lp: list[np.ndarray]
                     ) -> tuple[list[MemoryScore], int]:
        """The group's block scores, and how many blocks went unscored because their history had shown
        no gold answer yet (``scorer.scored_answers=shown``: nothing to remember, so no memory advantage)."""
        shown = shown_answers(self.tt, group, blocks) if self.tt is not None else [{}] * len(blocks)
        retained = (retention_labels(self.tt, group, blocks, shown) if self.tt is not None
                    else [-1] * len(blocks))  # no tokenizer (synthetic ids): nothing to judge
        scores: list[MemoryScore] = []
        unshown = 0
        only_shown = SCORED_ANSWERS.check(self.cfg.scored_answers) == "shown"  # an unknown value raises
        for (ei, ti), mem, kept, found in zip(blocks, mem_lp, retained, shown):
            if only_shown and not found:
                unshown += 1
                continue
            only = sorted(found) if only_shown else None  # None: every question
            full = full_lp[(ei, ti)]
            r = self.reward(full, mem, cont, only)
            t = group.episodes[ei].turns[ti]
            k = len(cont.question_spans())
            spans = (section_spans(self.tt, t.response_ids, t.mem_start, t.mem_end, k) if self.tt is not None
                     else np.zeros((0, 2), np.int32))
            scores.append(MemoryScore(group=gi, episode=ei, turn=ti,
                                      answer_ids=np.asarray(cont.answer_ids, np.int32),
                                      full_logp=full.astype(np.float32), mem_logp=mem.astype(np.float32),
                                      full_keep=r.full_keep, mem_keep=r.mem_keep,
                                      p_full=r.p_full, p_mem=r.p_mem, r_mem=r.r_mem, retained=kept,
                                      question_r_mem=self.question_rewards(full, mem, cont, only),
                                      question_spans=spans))
        return scores, unshown

    def question_rewards(self, full: np.ndarray, mem: np.ndarray, cont: Continuation, only) -> np.ndarray:
        """Each question's own R_mem (its answer span alone, under the same rule), for the questions in
        ``only`` (None: every one); NaN for a question not scored."""
        k = len(cont.question_spans())
        per_q = np.full(k, np.nan, np.float32)
        for q in only if only is not None else range(k):
            per_q[q] = self.reward(full, mem, cont, [q]).r_mem
        return per_q

    def rule(self) -> dict:
        """The reward's rule as configured (the scorer config's RULE fields): every score echoes it."""
        return {name: getattr(self.cfg, name) for name in RULE_FIELDS}

    def score_pair(self, mem_context: list[int], full_context: list[int], cont: Continuation) -> dict:
        """Score one continuation after two contexts (the REST endpoint's core)."""
        mem_lp = tree_logprobs(self.model, mem_context, [Branch(len(mem_context), cont.ids)], self.cfg.token_budget)[0]
        full_lp = tree_logprobs(self.model, full_context, [Branch(len(full_context), cont.ids)], self.cfg.token_budget)[0]
        a0, a1 = cont.answer_start, cont.answer_end
        r = self.reward(full_lp[a0:a1], mem_lp[a0:a1], cont)
        return {"p_mem": r.p_mem, "p_full": r.p_full, "r_mem": r.r_mem,
                "mem_logprobs": mem_lp[a0:a1].tolist(), "full_logprobs": full_lp[a0:a1].tolist(),
                "mem_keep": r.mem_keep.tolist(), "full_keep": r.full_keep.tolist(),
                "answer_ids": cont.answer_ids,
                "answer_tokens": [self.tt.token_bytes(i).decode("utf-8", "replace") for i in cont.answer_ids],
                **self.rule()}
