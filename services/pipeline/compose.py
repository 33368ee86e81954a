"""``mempo data compose``: MEM1-style k-objective tasks from any single-question set.

    mempo data compose questions.jsonl --out data/fanout --ks 1,2,3 --train-per-k 400 --test-per-k 50 \
        --test-share 0.25 --seed 0

reads every row of a single-question set in any format services/common/data.py accepts, splits the
questions into train and test by the entity each asks about (``entity`` or ``entities`` of the row, or
its id: every question about one entity lands on one side, so the test asks about entities training
never saw), and joins k questions about k different entities into one task, for each k, seeded. It
writes ``train.<fmt>`` and ``test.<fmt>`` in the output folder: JSONL rows ``{"id", "question": [k
questions], "answers": [k lists], "entities", "k"}``, or the Search-R1/verl parquet layout with
``extra_info.questions/answers/k`` (what the embedded world writes). ``train.data`` / ``eval.data``
read either; the pipeline gives every prompt MemPO's instructions.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from services.common.data import QUESTION_JOINER, read_rows, row_entities, row_golds, row_questions


@dataclass(frozen=True)
class Single:
    """One question of the input set."""

    id: str
    question: str
    answers: tuple[str, ...]
    entity: str
    source: str


def singles(path: str | Path) -> list[Single]:
    """The single questions of a question set (a row with k > 1 questions is an error)."""
    out = []
    for n, row in enumerate(read_rows(path, "compose input"), 1):
        try:
            questions = row_questions(row)
            golds = row_golds(row, len(questions))
        except ValueError as e:
            raise ValueError(f"{path} row {n}: {e} (docs/data.md)") from None
        if len(questions) != 1 or len(golds) != 1:
            raise ValueError(f"{path} row {n}: has {len(questions)} questions; compose takes single questions")
        ident = str(row.get("id", (row.get("extra_info") or {}).get("index", n)))
        entity = (row_entities(row) or ident).split(QUESTION_JOINER)[0]
        out.append(Single(ident, questions[0], tuple(golds[0]), entity, str(row.get("data_source", ""))))
    return out


def split_by_entity(items: list[Single], test_share: float, seed: int) -> tuple[list[Single], list[Single]]:
    """(train, test): the entities shuffled with ``seed``, the first ``test_share`` of them held out."""
    entities = sorted({s.entity for s in items})
    random.Random(f"split/{seed}").shuffle(entities)
    held = set(entities[: round(len(entities) * test_share)])
    return [s for s in items if s.entity not in held], [s for s in items if s.entity in held]


def tasks(items: list[Single], k: int, count: int, seed: int, split: str) -> list[dict]:
    """``count`` tasks of k questions about k different entities (a question may recur across tasks)."""
    by_entity: dict[str, list[Single]] = {}
    for s in items:
        by_entity.setdefault(s.entity, []).append(s)
    names = sorted(by_entity)
    if len(names) < k:
        raise ValueError(f"{split}: {len(names)} entities cannot make a task of {k} different ones; lower --ks or "
                         f"--test-share")
    rng = random.Random(f"{split}/{k}/{seed}")
    out = []
    for i in range(count):
        picked = [rng.choice(by_entity[e]) for e in rng.sample(names, k)]
        out.append({"id": f"{split}-k{k}-{i}", "question": [s.question for s in picked],
                    "answers": [list(s.answers) for s in picked], "entities": [s.entity for s in picked],
                    "k": k, "data_source": picked[0].source or "composed", "split": split, "index": i})
    return out


def to_verl(row: dict) -> dict:
    """A composed task in the Search-R1/verl parquet layout (extra_info as the embedded world writes it)."""
    return {"data_source": row["data_source"],
            "prompt": [{"role": "user", "content": QUESTION_JOINER.join(row["question"])}],
            "ability": "fact-reasoning",
            "reward_model": {"style": "rule", "ground_truth": {"target": row["answers"][0]}},
            "extra_info": {"split": row["split"], "index": row["index"], "k": row["k"],
                           "questions": row["question"], "answers": row["answers"]},
            "entities": row["entities"]}  # an extra column (verl ignores it): the eval's first-search diagnostic


def write_tasks(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        pd.DataFrame([to_verl(r) for r in rows]).to_parquet(path)
    else:
        path.write_text("".join(json.dumps({k: v for k, v in r.items() if k not in ("split", "index")},
                                           ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def compose(source: str | Path, out_dir: str | Path, ks: list[int], train_per_k: int, test_per_k: int,
            test_share: float = 0.25, seed: int = 0, fmt: str = "jsonl") -> dict[str, Path]:
    """Write ``<out_dir>/train.<fmt>`` and ``test.<fmt>``; returns their paths."""
    if fmt not in ("jsonl", "parquet"):
        raise ValueError(f"--format {fmt!r}: jsonl or parquet")
    if not 0 < test_share < 1:
        raise ValueError(f"--test-share {test_share}: must be in (0, 1)")
    train, test = split_by_entity(singles(source), test_share, seed)
    out = Path(out_dir)
    written = {}
    for split, items, per_k in (("train", train, train_per_k), ("test", test, test_per_k)):
        rows = [t for k in ks for t in tasks(items, k, per_k, seed, split)]
        written[split] = write_tasks(out / f"{split}.{fmt}", rows)
    return written
