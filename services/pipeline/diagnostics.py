"""What the agent did in one evaluated episode, beyond its score: the per-episode diagnostics.

    row = episode_row(ep, prompt, decode, separator=";")
    row -> {"em", "f1", "turns", "tt", "pt", "tool_failures", "answered", "well_formed",
            "first_search_hit", "answer_seen"}

Definitions (tests/pipeline/test_diagnostics.py pins each on hand-made episodes):
    well_formed       1 if the episode answered and every turn followed the grammar (the outcome
                      reward's format check), else 0
    answered          1 if the episode produced an <answer> at all
    first_search_hit  1 if the first search query contains the name of an entity the prompt asks
                      about (case-insensitive); 0 if it does not or the agent never searched; nan
                      when the prompt does not name its entities (``Prompt.extra["entities"]``)
    answer_seen       share of the prompt's questions whose gold answer (any alternative, after
                      SQuAD normalisation) appears in some observation the agent received: EM is
                      bounded by retrieval when this is low, and by copying when it is high
"""

from __future__ import annotations

import string
from typing import Callable

import numpy as np

from services.common.messages import Episode, Prompt
from services.algorithm.advantages import format_valid, outcome_reward
from services.common.rewards import normalize_answer


def prompt_entities(prompt: Prompt) -> list[str]:
    names = (prompt.extra or {}).get("entities")
    return [n.strip() for n in names.split(";") if n.strip()] if isinstance(names, str) else []


def first_search_hit(ep: Episode, entities: list[str]) -> float:
    if not entities:
        return float("nan")
    query = next((t.action_text for t in ep.turns if t.action == "search"), None)
    if query is None:
        return 0.0
    return float(any(e.lower() in query.lower() for e in entities))


def answer_seen(observations: list[str], golds: list[list[str]]) -> float:
    text = "".join(" " if ch in string.punctuation else ch for ch in " ".join(observations))  # "Kalton.</x>"
    seen = " " + normalize_answer(text) + " "
    hits = [any(f" {normalize_answer(g)} " in seen for g in alts if normalize_answer(g)) for alts in golds]
    return float(np.mean(hits)) if hits else float("nan")


def episode_row(ep: Episode, prompt: Prompt, decode: Callable[[list[int]], str], separator: str = ";") -> dict:
    em, f1 = outcome_reward(ep, prompt.golds, separator)
    observations = [decode(t.observation_ids.tolist()) for t in ep.turns if len(t.observation_ids)]
    return {"em": em, "f1": f1, "turns": float(len(ep.turns)), "tt": float(ep.total_tokens),
            "pt": float(ep.peak_tokens), "tool_failures": float(ep.tool_failures),
            "answered": float(ep.answer is not None), "well_formed": float(format_valid(ep)),
            "first_search_hit": first_search_hit(ep, prompt_entities(prompt)),
            "answer_seen": answer_seen(observations, prompt.golds)}
