"""Questions about the world and the train/test prompt sets, in the Search-R1 / verl parquet layout.

A *question* is one fact to find (1 hop: "Who founded Zentrix Labs?"; 2 hops: "In which city was
the founder of Zentrix Labs born?"). A *prompt* joins k questions with "; " (the paper's
multi-objective tasks). Train and test are entity-disjoint: no entity a test question asks about is
named in any training question (``split_by_entity``).

Parquet row (one prompt):
    data_source: "mempo_world"
    prompt: [{"role": "system", ...}, {"role": "user", "content": "q1; q2"}]
    ability: "fact-reasoning"
    reward_model: {"style": "rule", "ground_truth": {"target": ["a1; a2"]}}
    extra_info: {"split", "index", "k", "questions": [...], "answers": [[...], ...],
                 "hops": [...], "planted": ["<first-hop page id>", ...], "chains": "<json>"}
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass

import pandas as pd

from services.config import WorldConfig
from services.world.entities import World
from services.world.relations import ENTITY_LIST, RELATIONS, TWO_HOP

DATA_SOURCE = "mempo_world"


@dataclass(frozen=True)
class Hop:
    subject: str
    relation: str
    object: str


@dataclass(frozen=True)
class Question:
    text: str
    answer: str
    hops: tuple[Hop, ...]


def all_questions(world: World) -> tuple[list[Question], list[Question]]:
    """Every 1-hop and every 2-hop question the world supports (deterministic order)."""
    one, two = [], []
    for rel in RELATIONS.values():
        for e in ENTITY_LIST[rel.subject_kind](world):
            one.append(Question(rel.question.format(s=e.name), rel.get(world, e), (Hop(e.name, rel.name, rel.get(world, e)),)))
    by_name = world.index()
    for r1, r2, text in TWO_HOP:
        rel1, rel2 = RELATIONS[r1], RELATIONS[r2]
        for e in ENTITY_LIST[rel1.subject_kind](world):
            mid = rel1.get(world, e)
            end = rel2.get(world, by_name[mid])
            two.append(Question(text.format(s=e.name), end, (Hop(e.name, r1, mid), Hop(mid, r2, end))))
    return one, two


def split_by_entity(one: list[Question], two: list[Question], share: float, rng: random.Random
                    ) -> tuple[tuple[list[Question], list[Question]], tuple[list[Question], list[Question]]]:
    """(train pools, test pools), entity-disjoint: a ``share`` of the entities that questions ask
    about (first-hop subjects) is held out with every question about them, and no training question
    names a held-out entity. So a held-out question can only be answered by searching, never by
    recalling an answer seen in training."""
    subjects = sorted({q.hops[0].subject for q in one + two})
    rng.shuffle(subjects)
    held = set(subjects[: max(1, int(len(subjects) * share))])

    def is_test(q: Question) -> bool:
        return q.hops[0].subject in held

    def names_held(q: Question) -> bool:
        return any(name in q.text for name in held)

    train = tuple([q for q in pool if not is_test(q) and not names_held(q)] for pool in (one, two))
    test = tuple([q for q in pool if is_test(q)] for pool in (one, two))
    return train, test  # type: ignore[return-value]


def make_prompts(pools: tuple[list[Question], list[Question]], count: int, ks: list[int], two_hop_share: float,
                 rng: random.Random) -> list[list[Question]]:
    """``count`` prompts, each a list of k distinct questions (k cycles through ``ks``)."""
    one, two = pools
    prompts = []
    for i in range(count):
        k = ks[i % len(ks)]
        chosen: list[Question] = []
        for _attempt in range(1000 * k):
            if len(chosen) == k:
                break
            pool = two if (two and rng.random() < two_hop_share) or not one else one
            q = rng.choice(pool)
            if q not in chosen and all(q.hops[0].subject != c.hops[0].subject for c in chosen):
                chosen.append(q)
        if len(chosen) < k:
            raise ValueError(f"cannot draw {k} questions about distinct entities; the world is too small")
        prompts.append(chosen)
    return prompts


def prompt_row(questions: list[Question], split: str, index: int, system_prompt: str, page_ids: dict[str, str]) -> dict:
    user = "; ".join(q.text for q in questions)
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "system", "content": system_prompt}, {"role": "user", "content": user}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": ["; ".join(q.answer for q in questions)]}},
        "extra_info": {
            "split": split,
            "index": index,
            "k": len(questions),
            "questions": [q.text for q in questions],
            "answers": [[q.answer] for q in questions],
            "hops": [len(q.hops) for q in questions],
            "planted": [page_ids[q.hops[0].subject] for q in questions],
            "chains": json.dumps([[asdict(h) for h in q.hops] for q in questions]),
        },
    }


def build_question_sets(world: World, cfg: WorldConfig, system_prompt: str,
                        page_ids: dict[str, str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(train, test) DataFrames; test holds ``cfg.test_questions`` prompts for each k in test_objectives."""
    rng = random.Random(cfg.seed + 2)
    one, two = all_questions(world)
    train_pools, test_pools = split_by_entity(one, two, cfg.test_share, rng)
    train_prompts = make_prompts(train_pools, cfg.train_questions, cfg.train_objectives, cfg.two_hop_share, rng)
    test_prompts = []
    for k in cfg.test_objectives:
        test_prompts += make_prompts(test_pools, cfg.test_questions, [k], cfg.two_hop_share, rng)
    train = pd.DataFrame([prompt_row(p, "train", i, system_prompt, page_ids) for i, p in enumerate(train_prompts)])
    test = pd.DataFrame([prompt_row(p, "test", i, system_prompt, page_ids) for i, p in enumerate(test_prompts)])
    return train, test


def questions_of(row: dict) -> list[Question]:
    """Rebuild a prompt's Question objects from a parquet row's extra_info."""
    info = row["extra_info"]
    chains = json.loads(info["chains"])
    return [Question(text, chain[-1]["object"], tuple(Hop(**h) for h in chain))
            for text, chain in zip(info["questions"], chains)]
