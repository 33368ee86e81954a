"""The facts of the world as relations: how each is written in the corpus, asked, and read back.

One table, used by three parties so they can never disagree: the corpus writes an entity's page
from it, the question generator asks about it, and the oracle agent extracts the answer from a
retrieved page with the relation's regex (it reads passages, it does not peek at the graph).

    RELATIONS["born_in"].extract(page_text, "Ada Brenn")  # -> "Kaltonville" or None
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from services.world.entities import World


@dataclass(frozen=True)
class Relation:
    name: str
    subject_kind: str  # "person" | "company" | "city" | "university" | "country"
    question: str  # 1-hop question, {s} = subject
    phrase: str  # noun phrase for chaining: "the founder of {s}" (used as {s} of the next hop)
    query: str  # the oracle's search query, {s} = subject
    pattern: str  # regex over the subject's page; {s} = re.escape(subject); group "o" = answer
    memory: str  # how the oracle writes the fact in <mem>: "{s} was born in {o}"
    get: Callable[[World, object], str]  # the true object, from the graph

    def extract(self, text: str, subject: str) -> str | None:
        m = re.search(self.pattern.format(s=re.escape(subject)), text)
        return m.group("o").strip() if m else None


def _ent(kind: str) -> Callable[[World], list]:
    return {"person": lambda w: w.people, "company": lambda w: w.companies, "city": lambda w: w.cities,
            "university": lambda w: w.universities, "country": lambda w: w.countries}[kind]


ENTITY_LIST = {k: _ent(k) for k in ("person", "company", "city", "university", "country")}

RELATIONS: dict[str, Relation] = {r.name: r for r in [
    Relation("born_in", "person", "In which city was {s} born?", "the birthplace of {s}",
             "{s} born city", r"{s} is an? [^.]*? born in \d+ in the city of (?P<o>[^.]+)\.",
             "{s} was born in {o}", lambda w, e: e.born_in),
    Relation("birth_year", "person", "In what year was {s} born?", "the birth year of {s}",
             "{s} born year", r"{s} is an? [^.]*? born in (?P<o>\d+) in the city of",
             "{s} was born in {o}", lambda w, e: str(e.birth_year)),
    Relation("studied_at", "person", "Which university did {s} attend?", "the university attended by {s}",
             "{s} studied university", r"{s} studied at (?P<o>[^.]+)\.",
             "{s} studied at {o}", lambda w, e: e.university),
    Relation("founder", "company", "Who founded {s}?", "the founder of {s}",
             "{s} founded by", r"{s} is an? [^.]* company founded in \d+ by (?P<o>[^.]+)\.",
             "{s} was founded by {o}", lambda w, e: e.founder),
    Relation("headquarters", "company", "In which city is {s} headquartered?", "the headquarters city of {s}",
             "{s} headquartered", r"{s} is headquartered in (?P<o>[^.]+)\.",
             "{s} is headquartered in {o}", lambda w, e: e.headquarters),
    Relation("company_year", "company", "In what year was {s} founded?", "the founding year of {s}",
             "{s} founded year", r"{s} is an? [^.]* company founded in (?P<o>\d+) by",
             "{s} was founded in {o}", lambda w, e: str(e.founded)),
    Relation("city_country", "city", "In which country is {s} located?", "the country of {s}",
             "{s} city country", r"{s} is a city in (?P<o>[^.]+)\.",
             "{s} is in {o}", lambda w, e: e.country),
    Relation("university_city", "university", "In which city is {s} located?", "the city of {s}",
             "{s} located city", r"{s} is a university located in (?P<o>[^.]+)\.",
             "{s} is located in {o}", lambda w, e: e.city),
    Relation("capital", "country", "What is the capital of {s}?", "the capital of {s}",
             "{s} capital", r"The capital of {s} is (?P<o>[^.]+)\.",
             "the capital of {s} is {o}", lambda w, e: e.capital),
]}

# Which relation can follow which (the object kind of the first is the subject kind of the second).
OBJECT_KIND = {"born_in": "city", "studied_at": "university", "founder": "person", "headquarters": "city",
               "city_country": "country", "university_city": "city", "capital": "city",
               "birth_year": None, "company_year": None}

# Two-hop question templates: (first relation, second relation, question with {s} = first subject).
TWO_HOP = [
    ("born_in", "city_country", "In which country was {s} born?"),
    ("founder", "born_in", "In which city was the founder of {s} born?"),
    ("founder", "studied_at", "Which university did the founder of {s} attend?"),
    ("founder", "birth_year", "In what year was the founder of {s} born?"),
    ("headquarters", "city_country", "In which country is {s} headquartered?"),
    ("studied_at", "university_city", "In which city is the university that {s} attended?"),
    ("university_city", "city_country", "In which country is {s} located?"),
]


def page_text(world: World, kind: str, e) -> str:
    """The body of an entity's own page (the passage every relation of it is read from)."""
    if kind == "person":
        founded = [c.name for c in world.companies if c.founder == e.name]
        art = "an" if e.profession[0] in "aeiou" else "a"
        text = (f"{e.name} is {art} {e.profession} born in {e.birth_year} in the city of {e.born_in}. "
                f"{e.name} studied at {e.university}.")
        if founded:
            text += f" {e.name} later founded {', '.join(founded)}."
        return text
    if kind == "company":
        art = "an" if e.industry[0] in "aeiou" else "a"
        return (f"{e.name} is {art} {e.industry} company founded in {e.founded} by {e.founder}. "
                f"{e.name} is headquartered in {e.headquarters}.")
    if kind == "city":
        unis = [u.name for u in world.universities if u.city == e.name]
        text = f"{e.name} is a city in {e.country}."
        if any(c.capital == e.name for c in world.countries):
            text += f" It is the capital of {e.country}."
        if unis:
            text += f" {e.name} is home to {', '.join(unis)}."
        return text
    if kind == "university":
        return f"{e.name} is a university located in {e.city}. It was founded in {e.founded}."
    if kind == "country":
        cities = [c.name for c in world.cities if c.country == e.name]
        return f"{e.name} is a country. The capital of {e.name} is {e.capital}. Its cities include {', '.join(cities)}."
    raise ValueError(f"unknown entity kind {kind!r}")
