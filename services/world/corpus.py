"""The world's retrieval corpus, in the Search-R1 JSONL format.

Each row is ``{"id": "<n>", "contents": "\\"Title\\"\\ntext"}``. Every entity has its own page (the
*planted* passage for questions about it) and ``distractors_per_entity`` distractor passages whose
titles contain the entity's name and which mention it next to wrong answers of the right type
(an award held in another city, an arena in another town, ...), so retrieval has to rank.

    rows, page_ids = build_corpus(world, cfg)   # page_ids: entity name -> id of its page
    write_jsonl(rows, path)
"""

from __future__ import annotations

import random

from services.config import WorldConfig
from services.world.entities import World
from services.world.relations import ENTITY_LIST, page_text

_DISTRACTORS = {
    "person": [
        lambda e, w, r: (f"{e.name} Prize", f"The {e.name} Prize is awarded every year in {r.choice(w.cities).name} "
                         f"to a young {e.profession}. The ceremony is held at {r.choice(w.universities).name}."),
        lambda e, w, r: (f"{e.name} Foundation", f"The {e.name} Foundation funds libraries in {r.choice(w.cities).name} "
                         f"and gave its first grant in {r.randint(1950, 2020)}."),
    ],
    "company": [
        lambda e, w, r: (f"{e.name} Arena", f"{e.name} Arena is a stadium in {r.choice(w.cities).name}, "
                         f"sponsored by {e.name} since {r.randint(1950, 2020)}. It was designed by {r.choice(w.people).name}."),
        lambda e, w, r: (f"{e.name} Cup", f"The {e.name} Cup is a chess tournament first played in {r.choice(w.cities).name} "
                         f"and won by {r.choice(w.people).name}."),
    ],
    "city": [
        lambda e, w, r: (f"{e.name} Festival", f"The {e.name} Festival is a music festival held each summer in "
                         f"{r.choice(w.countries).name}, named after the city of {e.name}."),
        lambda e, w, r: (f"{e.name} Street", f"{e.name} Street is a shopping street in {r.choice(w.cities).name}."),
    ],
    "university": [
        lambda e, w, r: (f"{e.name} Press", f"{e.name} Press is a publisher based in {r.choice(w.cities).name}, "
                         f"founded in {r.randint(1800, 2000)}."),
    ],
    "country": [
        lambda e, w, r: (f"{e.name} Airways", f"{e.name} Airways is an airline headquartered in {r.choice(w.cities).name}."),
    ],
}


def build_corpus(world: World, cfg: WorldConfig) -> tuple[list[dict], dict[str, str]]:
    """All passages (pages first, then distractors, shuffled by seed) and entity -> page id."""
    rng = random.Random(cfg.seed + 1)
    passages: list[tuple[str, str, str | None]] = []  # (title, text, entity whose page it is)
    for kind, items in ENTITY_LIST.items():
        for e in items(world):
            passages.append((e.name, page_text(world, kind, e), e.name))
            makers = _DISTRACTORS[kind]
            for i in range(cfg.distractors_per_entity):
                title, text = makers[i % len(makers)](e, world, rng)
                passages.append((title, text, None))
    rng.shuffle(passages)
    rows, page_ids = [], {}
    for i, (title, text, owner) in enumerate(passages):
        rows.append({"id": str(i), "contents": f"\"{title}\"\n{text}"})
        if owner is not None:
            page_ids[owner] = str(i)
    return rows, page_ids
