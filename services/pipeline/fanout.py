"""``mempo data fanoutqa``: a real, small question set from FanOutQA's dev split, with a corpus to search.

    mempo data fanoutqa data/fanoutqa          # questions.jsonl (1,788 single questions) + corpus.jsonl
    mempo data compose data/fanoutqa/questions.jsonl --out data/fanoutqa --ks 1,2,3

FanOutQA (Zhu et al. 2024, CC BY-SA 4.0) ships its 310 dev questions inside the ``fanoutqa`` package;
each is decomposed into sub-questions, every leaf answered from one Wikipedia page. The leaves with a
single short answer (a string or number) are our single questions; the entity each asks about is its
evidence page, so ``mempo data compose`` holds out whole pages.

The corpus is **generated, not Wikipedia**: the package has no page text, and nothing here may
download it. Each evidence page becomes one passage titled with the page, stating every leaf fact
of that page as "question: answer." (several facts per page, so a retrieved page holds the asked fact
among others). It is an oracle corpus: each answer is in exactly its page's passage. Point
``search.corpus`` at it; its BM25 index is built on first use.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

DEV_FILE = "fanout-final-dev.json"


def dev_questions() -> list[dict]:
    """FanOutQA's dev questions as the package ships them (read without importing its modules)."""
    spec = importlib.util.find_spec("fanoutqa")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the fanoutqa package is not installed: `pip install --no-deps fanoutqa` "
                                "(make setup installs it)")
    path = Path(spec.submodule_search_locations[0]) / "data" / DEV_FILE
    return json.loads(path.read_text(encoding="utf-8"))


def _leaves(sub: dict):
    if sub.get("decomposition"):
        for s in sub["decomposition"]:
            yield from _leaves(s)
    else:
        yield sub


def single_questions(questions: list[dict]) -> list[dict]:
    """Every leaf sub-question with one short answer (str/int/float; lists, dicts and yes/no left out)
    and an evidence page: ``{"id", "question", "answers", "entity", "data_source"}``."""
    out, seen = [], set()
    for q in questions:
        for leaf in (x for s in q["decomposition"] for x in _leaves(s)):
            answer, evidence = leaf.get("answer"), leaf.get("evidence") or {}
            if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or not evidence.get("title"):
                continue
            text = str(answer).strip()
            if not text or leaf["id"] in seen:
                continue
            seen.add(leaf["id"])
            out.append({"id": leaf["id"], "question": leaf["question"].strip(), "answers": [text],
                        "entity": evidence["title"], "data_source": "fanoutqa"})
    return out


def corpus(singles: list[dict]) -> list[dict]:
    """One generated passage per evidence page, in Search-R1's corpus format (``contents`` =
    '"title"\\ntext')."""
    pages: dict[str, list[str]] = {}
    for s in singles:
        pages.setdefault(s["entity"], []).append(f"{s['question'].rstrip('?').strip()}: {s['answers'][0]}.")
    return [{"id": str(i), "contents": f"\"{title}\"\n" + " ".join(facts)}
            for i, (title, facts) in enumerate(sorted(pages.items()))]


def write_fanoutqa(out_dir: str | Path) -> dict[str, Path]:
    """Write ``questions.jsonl`` and ``corpus.jsonl`` into ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    singles = single_questions(dev_questions())
    paths = {"questions": out / "questions.jsonl", "corpus": out / "corpus.jsonl"}
    for name, rows in (("questions", singles), ("corpus", corpus(singles))):
        paths[name].write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return paths
