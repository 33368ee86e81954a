"""Prompt sets in the Search-R1 / verl parquet layout -> protocol ``Prompt`` messages.

    prompts = load_prompts("train.parquet")                  # every row
    prompts = load_prompts("test.parquet", k=2, limit=100)   # only 2-objective prompts, first 100

A row's gold answers per objective come from ``extra_info.answers`` when present (the embedded
world writes it), else from ``reward_model.ground_truth.target`` (Search-R1 datasets: a list of
acceptable answers of a single question).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import pandas as pd

from services.common.messages import ChatMessage, Prompt


def row_to_prompt(row: dict, split: str = "") -> Prompt:
    info = row.get("extra_info") or {}
    answers = info.get("answers")
    if answers is not None and len(answers):
        golds = [[str(a) for a in alts] for alts in answers]
    else:
        target = row["reward_model"]["ground_truth"]["target"]
        golds = [[str(t) for t in (target if not isinstance(target, str) else [target])]]
    index = info.get("index", "")
    extra = {k: v for k, v in {"k": info.get("k"), "index": index}.items() if isinstance(v, (int, float, str))}
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
