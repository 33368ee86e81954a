"""Outcome rewards (docs/algorithm.md, section 5): exact match and F1 with SQuAD normalisation.

A multi-objective answer ("a1; a2") is split on the separator and scored per question; the reward
is the fraction of questions answered correctly.

    exact_match("The Reed College", ["Reed College"])             -> 1.0
    multi_objective_em("Kalton; 1950", [["Kalton"], ["1951"]])    -> 0.5
"""

from __future__ import annotations

import re
import string
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lowercase, drop punctuation and articles, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, golds: list[str]) -> float:
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golds))


def f1_score(prediction: str, golds: list[str]) -> float:
    best = 0.0
    pred = normalize_answer(prediction).split()
    for g in golds:
        gold = normalize_answer(g).split()
        common = sum((Counter(pred) & Counter(gold)).values())
        if common == 0:
            continue
        p, r = common / len(pred), common / len(gold)
        best = max(best, 2 * p * r / (p + r))
    return best


def split_objectives(answer: str, k: int, separator: str = ";") -> list[str]:
    """Split a k-objective answer; missing parts are empty strings, extra parts are dropped."""
    parts = [p.strip() for p in answer.split(separator)] if k > 1 else [answer.strip()]
    return (parts + [""] * k)[:k]


def multi_objective_em(answer: str | None, golds: list[list[str]], separator: str = ";") -> float:
    """Fraction of the k questions whose part of ``answer`` matches; 0 if there is no answer."""
    if answer is None or not golds:
        return 0.0
    parts = split_objectives(answer, len(golds), separator)
    return sum(exact_match(p, g) for p, g in zip(parts, golds)) / len(golds)


def multi_objective_f1(answer: str | None, golds: list[list[str]], separator: str = ";") -> float:
    if answer is None or not golds:
        return 0.0
    parts = split_objectives(answer, len(golds), separator)
    return sum(f1_score(p, g) for p, g in zip(parts, golds)) / len(golds)
