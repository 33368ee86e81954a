"""``mempo data transcripts``: MemPO SFT transcripts for your own questions, written by a gold-known oracle.

    mempo data transcripts CONFIG --out sft.jsonl [--limit N]   # train.data's questions, search.corpus

For a corpus that holds the gold passages (retrieval with the gold answer known), this oracle solves
each task of ``train.data`` in the exact MemPO turn grammar, the way the embedded world's oracle does
for the world: one question at a time it searches the question's text on the config's retrieval index
(``search.corpus``, ``search.backend``, ``search.topk``, the agent's passage format), reads the answer
as the gold answer found in a returned passage, and keeps what it knows only in its ``<mem>`` rewrite
(question, answer found, what is still missing). A question whose gold no returned passage states is
searched once more with the question's entity when the row names one, then given up ("unknown"); the
transcript's ``em`` says how the answer scored, so ``train.sft_min_em`` filters it. Rows are JSONL
``{"messages", "em", "id"}``: what ``train.sft_data`` reads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from services.common.data import QUESTION_JOINER, row_entities, row_golds, row_questions
from services.common.passage_format import format_passages, split_contents
from services.common.rewards import multi_objective_em, normalize_answer
from services.common.turn_format import FINAL_THINK, render_information, render_turn

SearchFn = Callable[[str], list[dict]]  # query -> passages ({"id", "contents"}), best first


@dataclass
class _Goal:
    question: str
    golds: list[str]
    entity: str | None
    found: str | None = None
    tries: int = 0

    @property
    def open(self) -> bool:
        return self.found is None and self.tries < (2 if self.entity else 1)


def _gold_in(docs: list[dict], golds: list[str]) -> str | None:
    """The first gold answer a passage states (normalised text containment), else None."""
    wanted = [(gold, f" {normalize_answer(gold)} ") for gold in golds if normalize_answer(gold)]
    for doc in docs:
        text = " " + normalize_answer(" ".join(split_contents(doc["contents"]))) + " "
        for gold, needle in wanted:
            if needle in text:
                return gold
    return None


def _memory(goals: list[_Goal]) -> str:
    lines = []
    for i, g in enumerate(goals, 1):
        lines.append(f"Q{i}: {g.question}")
        if g.found is not None:
            lines.append(f"- Answer: {g.found}")
        elif g.open:
            lines.append("- Still needed: its answer.")
        else:
            lines.append("- Not found; answer unknown.")
    return "\n".join(lines)


def solve(questions: list[str], golds: list[list[str]], entities: list[str], system_prompt: str, search: SearchFn,
          doc_format: str, max_turns: int) -> dict:
    """One transcript (``{"messages", "em"}``) for a task whose gold answers are known."""
    goals = [_Goal(q, g, entities[i] if i < len(entities) else None) for i, (q, g) in enumerate(zip(questions, golds))]
    messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": QUESTION_JOINER.join(questions)}]
    for turn in range(1, max_turns + 1):
        mem = _memory(goals) if turn > 1 else None
        pending = [g for g in goals if g.open]
        if not pending or turn == max_turns:
            answer = "; ".join(g.found if g.found is not None else "unknown" for g in goals)
            think = FINAL_THINK if not pending else "I am out of turns."
            messages.append({"role": "assistant", "content": render_turn(think, mem=mem, answer=answer)})
            return {"messages": messages, "em": multi_objective_em(answer, golds)}
        g = pending[0]
        query = g.question if g.tries == 0 else g.entity
        think = (f"I need to answer {len(goals)} question(s). First I will search for: {g.question}" if turn == 1
                 else f"I still need the answer to: {g.question} I will search for it.")
        messages.append({"role": "assistant", "content": render_turn(think, mem=mem, search=query)})
        docs = search(query)
        messages.append({"role": "user", "content": render_information(format_passages(docs, doc_format))})
        g.tries += 1
        g.found = _gold_in(docs, g.golds)
    raise AssertionError("unreachable: the last turn always answers")


def write_transcripts(rows: list[dict], system_prompt: str, search: SearchFn, out: str | Path, doc_format: str,
                      max_turns: int, progress=None) -> dict:
    """Solve every row (any format services/common/data.py accepts) and write the JSONL; returns counts."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    solved = 0
    with open(out, "w", encoding="utf-8") as f:
        for n, row in enumerate(progress(rows) if progress else rows, 1):
            questions = row_questions(row)
            entities = (row_entities(row) or "").split(QUESTION_JOINER)
            t = solve(questions, row_golds(row, len(questions)), entities, system_prompt, search, doc_format, max_turns)
            solved += t["em"] == 1.0
            f.write(json.dumps({"id": str(row.get("id", n)), **t}, ensure_ascii=False) + "\n")
    return {"written": len(rows), "em_1": solved}
