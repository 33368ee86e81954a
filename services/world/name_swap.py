"""Counterfactual names for SFT transcripts: rename the people, companies and universities of a
transcript, consistently, to fresh combinations of the world's own name words.

Why: a tiny policy trained on oracle transcripts of training entities learns which family name
follows which given name, and on a held-out entity it copies the first word of the name and then
writes a memorised partner (``Krind Pedousios`` for ``Krind Chakrin``; docs/experiments.md). In a
renamed transcript the second word cannot be predicted from the first, only copied from the
question or an observation, so the loss rewards copying. Renaming is consistent through the whole
transcript (question, memory, queries, observations, answer), so every transcript stays a correct
solution of its own question. A fresh name is never a name of the world, so no held-out entity can
appear in the training data this way.

    swapper = NameSwapper.from_world_file(Path(".cache/world/<key>/world.json"))
    renamed = swapper.rename(messages, random.Random(0))   # a new list; the system message is kept
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

_UNIVERSITY_PREFIX = "University of "


def _university_stem(name: str) -> tuple[str, str]:
    """(stem, form) of a university name: ``"University of {n}"`` or ``"{n} <rest>"``."""
    if name.startswith(_UNIVERSITY_PREFIX):
        return name[len(_UNIVERSITY_PREFIX):], _UNIVERSITY_PREFIX + "{n}"
    stem, _, rest = name.partition(" ")
    return stem, "{n} " + rest


class NameSwapper:
    """Renames person ("Given Family"), company ("Stem Suffix") and university names."""

    def __init__(self, people: list[str], companies: list[str], universities: list[str], taken: set[str]):
        self.given = sorted({p.split(" ", 1)[0] for p in people})
        self.family = sorted({p.split(" ", 1)[1] for p in people if " " in p})
        self.stems = sorted({c.split(" ", 1)[0] for c in companies} | {_university_stem(u)[0] for u in universities})
        self.kind = {**{p: "person" for p in people}, **{c: "company" for c in companies},
                     **{u: "university" for u in universities}}
        self.taken = set(taken)
        names = sorted(self.kind, key=len, reverse=True)  # longest first: a name inside another is not cut
        self.pattern = re.compile(r"(?<!\w)(" + "|".join(map(re.escape, names)) + r")(?!\w)") if names else None

    @classmethod
    def from_world_file(cls, path: Path) -> "NameSwapper":
        """From a built world's ``world.json`` (the entity graph)."""
        if not path.is_file():
            raise FileNotFoundError(f"train.sft_name_swap renames the embedded world's entities and needs its graph, "
                                    f"{path}, which does not exist: set train.sft_name_swap=0 for your own transcripts")
        world = json.loads(path.read_text())
        taken = {e["name"] for kind in ("countries", "cities", "universities", "people", "companies") for e in world[kind]}
        return cls([p["name"] for p in world["people"]], [c["name"] for c in world["companies"]],
                   [u["name"] for u in world["universities"]], taken)

    def fresh(self, name: str, rng: random.Random, used: set[str]) -> str:
        """A new name of the same kind as ``name`` that is neither a world name nor in ``used``."""
        kind = self.kind[name]
        for _ in range(200):
            if kind == "person":
                new = f"{rng.choice(self.given)} {rng.choice(self.family)}"
            elif kind == "company":  # the suffix says the industry, which the page states: keep it
                new = f"{rng.choice(self.stems)} {name.split(' ', 1)[1]}"
            else:
                new = _university_stem(name)[1].format(n=rng.choice(self.stems))
            if new not in self.taken and new not in used:
                return new
        raise ValueError(f"cannot draw a fresh name for {name!r}: the world's name inventory is too small")

    def rename(self, messages: list[dict], rng: random.Random) -> list[dict]:
        """A copy of ``messages`` with every known name replaced by its fresh counterpart."""
        if self.pattern is None:
            return [dict(m) for m in messages]
        mapping: dict[str, str] = {}
        for m in messages[1:]:
            for name in self.pattern.findall(m["content"]):
                if name not in mapping:
                    mapping[name] = self.fresh(name, rng, set(mapping.values()))
        out = [dict(messages[0])]
        for m in messages[1:]:
            out.append({**m, "content": self.pattern.sub(lambda hit: mapping[hit.group(1)], m["content"])})
        return out
