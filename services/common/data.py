"""Question sets -> protocol ``Prompt`` messages: Search-R1 / verl parquet as published, and JSONL.

    prompts = load_prompts("train.parquet", system_prompt)            # every row, MemPO's instructions
    prompts = load_prompts("test.jsonl", system_prompt, k=2, limit=100)  # 2-objective rows, first 100
    objectives_in("test.parquet")                                      # the k values present: [1, 2, 4]
    stream = PromptStream(prompts, per_step=8, seed=0); stream.at(step)  # the prompts of RL step ``step``

Accepted rows (docs/data.md has worked examples), in a ``.parquet`` file or a ``.jsonl`` file:

- **Search-R1 / verl layout**: ``prompt`` (chat messages), ``reward_model.ground_truth.target`` (the
  acceptable answers of one question), ``extra_info`` (``index``, ``split``; the embedded world adds
  ``k``, ``questions`` and ``answers``, one list of acceptable answers per question). Search-R1's
  published files also keep their ``question`` and ``golden_answers`` columns.
- **Plain questions**: ``question`` (a string, or a list of k strings for a k-objective task) and
  ``answers`` (or ``golden_answers``, or ``answer``): the acceptable answers of one question, or a list
  of such lists, one per question; optional ``id``, ``data_source``, ``entities``.

The rule for instructions: every prompt is ``[system: rollout.system_prompt, user: the question(s)]``,
whatever the row's source. A row's own system message and instruction text are replaced, since the
MemPO turn grammar (``<mem>`` from turn 2 on) is what the format rule checks: the question is the row's
``extra_info.questions`` or ``question`` when present, else the text after the last ``Question:`` of
its last user message (Search-R1's template), else that whole message. k questions are joined by "; ".
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Optional

import pandas as pd

from services.common.messages import ChatMessage, Prompt

QUESTION_JOINER = "; "  # how k questions share one user message (the system prompt says so)
SUFFIXES = (".parquet", ".jsonl")


class DataError(ValueError):
    """A question set that cannot be read: the message names the file, the row and what is missing."""


def _plain(value: Any) -> Any:
    """numpy arrays and scalars (what parquet gives back) as Python lists and scalars."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def read_rows(path: str | Path, setting: str = "data") -> list[dict]:
    """The rows of a ``.parquet`` or ``.jsonl`` question set; ``setting`` names the config field in errors."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{setting}: {p} does not exist")
    if p.suffix == ".parquet":
        return pd.read_parquet(p).to_dict("records")
    if p.suffix != ".jsonl":
        raise DataError(f"{setting}: {p} is neither .parquet nor .jsonl (docs/data.md lists the accepted formats)")
    rows = []
    with open(p, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{setting}: {p} line {n} is not JSON ({e.msg})") from None
                if not isinstance(row, dict):
                    raise DataError(f"{setting}: {p} line {n} is not a JSON object")
                rows.append(row)
    return rows


def _answer_lists(value: Any, k: int) -> list[list[str]]:
    """Acceptable answers per question from a string, a list of strings (one question) or a list of lists."""
    value = _plain(value)
    if isinstance(value, str):
        return [[value]]
    if isinstance(value, list) and value and all(isinstance(v, list) or hasattr(v, "tolist") for v in value):
        return [[str(a) for a in _plain(alts)] for alts in value]
    if isinstance(value, list) and value:
        return [[str(a) for a in value]] if k == 1 else [[str(a)] for a in value]
    raise ValueError("no answers")


def row_golds(row: dict, k_hint: int) -> list[list[str]]:
    """A row's acceptable answers, one list per question (``k_hint``: its number of questions)."""
    info = row.get("extra_info") or {}
    answers = _plain(info.get("answers"))
    if answers is not None and len(answers):
        return _answer_lists(answers, k_hint)
    for key in ("answers", "golden_answers", "answer"):
        if row.get(key) is not None:
            return _answer_lists(row[key], k_hint)
    target = ((row.get("reward_model") or {}).get("ground_truth") or {}).get("target")
    if target is not None:
        return _answer_lists(target, 1)
    raise ValueError("no answers: give 'answers' (or Search-R1's reward_model.ground_truth.target)")


def row_questions(row: dict) -> list[str]:
    """A row's question(s), by the rule of the module docstring."""
    info = row.get("extra_info") or {}
    for value in (info.get("questions"), row.get("question")):
        value = _plain(value)
        if isinstance(value, str) and value.strip():
            return [value.strip()]
        if isinstance(value, list) and value and all(isinstance(q, str) and q.strip() for q in value):
            return [q.strip() for q in value]
    users = [m for m in _plain(row.get("prompt")) or [] if isinstance(m, dict) and m.get("role") == "user"]
    if users and str(users[-1].get("content", "")).strip():
        text = str(users[-1]["content"])
        if "Question:" in text:  # Search-R1's template: instructions, then "Question: ...\n"
            text = text.rsplit("Question:", 1)[1]
        return [text.strip()]
    raise ValueError("no question: give 'question' (or a 'prompt' with a user message)")


def row_entities(row: dict) -> Optional[str]:
    """The entity each question asks about, joined by "; ": a row's ``entities``, or the embedded
    world's ``extra_info.chains`` (each chain's first subject); the eval's first-search diagnostic uses it."""
    given = _plain(row.get("entities", row.get("entity")))
    if isinstance(given, str) and given:
        return given
    if isinstance(given, list) and given:
        return QUESTION_JOINER.join(str(e) for e in given)
    chains = (row.get("extra_info") or {}).get("chains")
    if not isinstance(chains, str):
        return None
    try:
        return QUESTION_JOINER.join(str(chain[0]["subject"]) for chain in json.loads(chains))
    except (ValueError, LookupError, TypeError):
        return None


def row_to_prompt(row: dict, system_prompt: str, split: str = "", where: str = "row") -> Prompt:
    """One accepted row as a Prompt under MemPO's instructions (see the module docstring for the rule)."""
    try:
        questions = row_questions(row)
        golds = row_golds(row, len(questions))
    except ValueError as e:
        raise DataError(f"{where}: {e} (docs/data.md lists the accepted formats)") from None
    if len(golds) != len(questions):
        raise DataError(f"{where}: {len(questions)} question(s) but answers for {len(golds)}")
    info = row.get("extra_info") or {}
    index = info.get("index", row.get("id", ""))
    extra = {"k": len(questions), "index": _plain(index), "entities": row_entities(row)}
    extra = {key: v for key, v in extra.items() if isinstance(v, (int, float, str))}
    messages = [ChatMessage(role="system", content=system_prompt),
                ChatMessage(role="user", content=QUESTION_JOINER.join(questions))]
    return Prompt(uid=f"{split or info.get('split', 'row')}-{index}", messages=messages, golds=golds,
                  data_source=str(row.get("data_source", "")), extra=extra)


def row_k(row: dict) -> int:
    """A row's objective count: ``extra_info.k`` when given, else its number of questions."""
    k = (row.get("extra_info") or {}).get("k", row.get("k"))
    if k is not None:
        return int(k)
    try:
        return len(row_questions(row))
    except ValueError:
        return 1


def load_prompts(path: str | Path, system_prompt: str, k: Optional[int] = None, limit: Optional[int] = None,
                 setting: str = "data") -> list[Prompt]:
    """The prompts of a question set (only its k-objective rows when ``k`` is given, the first ``limit``)."""
    return _prompts(read_rows(path, setting), system_prompt, k, limit, f"{setting}: {path}")


def _prompts(rows: list[dict], system_prompt: str, k: Optional[int], limit: Optional[int], where: str) -> list[Prompt]:
    numbered = [(n, r) for n, r in enumerate(rows, 1) if k is None or row_k(r) == k]
    if limit is not None:
        numbered = numbered[:limit]
    return [row_to_prompt(r, system_prompt, where=f"{where} row {n}") for n, r in numbered]


def prompts_per_k(path: str | Path, system_prompt: str, ks: list[int], limit: Optional[int] = None,
                  setting: str = "eval.data") -> dict[int, list[Prompt]]:
    """{k: the first ``limit`` k-objective prompts} for each k of ``ks`` (empty = every k the file has),
    the file read once; a k with no rows is a DataError naming the k values the file has."""
    rows = read_rows(path, setting)
    present = sorted({row_k(r) for r in rows})
    out = {k: _prompts(rows, system_prompt, k, limit, f"{setting}: {path}") for k in (ks or present)}
    empty = [k for k, v in out.items() if not v]
    if empty:
        raise DataError(f"eval.objectives: no held-out prompts with k in {empty} in {path} (its rows have k in "
                        f"{present}; leave eval.objectives empty to evaluate those)")
    return out


def objectives_in(path: str | Path, setting: str = "eval.data") -> list[int]:
    """The objective counts k present in a question set, ascending."""
    return sorted({row_k(r) for r in read_rows(path, setting)})


class PromptStream:
    """Training prompts in a seeded order, reshuffled every epoch; ``at(step)`` is a pure function of
    the step, so a resumed run continues with exactly the prompts it would have seen."""

    def __init__(self, prompts: list[Prompt], per_step: int, seed: int = 0):
        if not prompts:
            raise ValueError("no training prompts")
        self.prompts, self.per_step, self.seed = prompts, per_step, seed
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.prompts)))
            random.Random(f"{self.seed}/{epoch}").shuffle(order)
            self._orders[epoch] = order
        return self._orders[epoch]

    def at(self, step: int) -> list[Prompt]:
        return [self.prompt_at(p) for p in range(step * self.per_step, (step + 1) * self.per_step)]

    def prompt_at(self, position: int) -> Prompt:
        """The prompt at ``position`` of the endless seeded order (epoch ``position // len(prompts)``)."""
        n = len(self.prompts)
        return self.prompts[self._order(position // n)[position % n]]
