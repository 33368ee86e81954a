"""Prompt sets in the Search-R1 / verl parquet layout -> protocol ``Prompt`` messages.

    prompts = load_prompts("train.parquet")                  # every row
    prompts = load_prompts("test.parquet", k=2, limit=100)   # only 2-objective prompts, first 100
    stream = PromptStream(prompts, per_step=8, seed=0); stream.at(step)  # the prompts of RL step ``step``

A row's gold answers per objective come from ``extra_info.answers`` when present (the embedded
world writes it), else from ``reward_model.ground_truth.target`` (Search-R1 datasets: a list of
acceptable answers of a single question). ``Prompt.extra["entities"]`` names the entity each
question asks about, when the row says (``extra_info.chains``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Optional

import pandas as pd

from services.common.messages import ChatMessage, Prompt


def _entities(info: dict) -> Optional[str]:
    """The entity each question asks about (its first hop's subject), joined by "; ", when the row
    carries the embedded world's ``extra_info.chains``; the eval's first-search diagnostic uses it."""
    chains = info.get("chains")
    if not isinstance(chains, str):
        return None
    try:
        return "; ".join(str(chain[0]["subject"]) for chain in json.loads(chains))
    except (ValueError, LookupError, TypeError):
        return None


def row_to_prompt(row: dict, split: str = "") -> Prompt:
    info = row.get("extra_info") or {}
    answers = info.get("answers")
    if answers is not None and len(answers):
        golds = [[str(a) for a in alts] for alts in answers]
    else:
        target = row["reward_model"]["ground_truth"]["target"]
        golds = [[str(t) for t in (target if not isinstance(target, str) else [target])]]
    index = info.get("index", "")
    extra = {k: v for k, v in {"k": info.get("k"), "index": index, "entities": _entities(info)}.items()
             if isinstance(v, (int, float, str))}
    extra = {k: int(v) if hasattr(v, "item") else v for k, v in extra.items()}
    return Prompt(uid=f"{split or info.get('split', 'row')}-{index}",
                  messages=[ChatMessage(role=m["role"], content=m["content"]) for m in row["prompt"]],
                  golds=golds, data_source=str(row.get("data_source", "")), extra=extra)


def load_prompts(path: str | Path, k: Optional[int] = None, limit: Optional[int] = None) -> list[Prompt]:
    df = pd.read_parquet(path)
    rows = df.to_dict("records")
    if k is not None:
        rows = [r for r in rows if int((r.get("extra_info") or {}).get("k", 1)) == k]
    if limit is not None:
        rows = rows[:limit]
    return [row_to_prompt(r) for r in rows]


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
        n = len(self.prompts)
        positions = range(step * self.per_step, (step + 1) * self.per_step)
        return [self.prompts[self._order(p // n)[p % n]] for p in positions]
