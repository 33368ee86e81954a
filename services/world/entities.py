"""The synthetic knowledge graph behind the embedded world, generated from a seed.

Fictional countries, cities, universities, people and companies with relations between them:
a city lies in a country (and one city per country is its capital), a university is located in a
city, a person was born in a city in some year and studied at a university, a company was founded
by a person in some year and is headquartered in a city. Names are built from syllables so no fact
can be known without searching the world's corpus.

    from services.world.entities import generate_world
    world = generate_world(WorldConfig(seed=0))
    world.people[0].born_in  # -> a city name
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

from services.config import WorldConfig

_ONSETS = ["b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "l", "m", "n", "p", "r", "s", "st",
           "t", "tr", "v", "w", "z", "th", "sh", "ch", "kr", "pl", "fl"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "io", "ou", "y"]
_CODAS = ["", "", "n", "r", "l", "s", "th", "m", "nd", "rk", "x", "v"]
_CITY_SUFFIX = ["", "", "ton", "ville", "burg", "mouth", "field", "haven", "ford", "stead"]
_COUNTRY_SUFFIX = ["ia", "land", "ora", "istan", "mark", "ania", "eth"]
_UNI_FORMS = ["{n} University", "University of {n}", "{n} Institute of Technology", "{n} College"]
_COMPANY_SUFFIX = ["Labs", "Systems", "Dynamics", "Works", "Industries", "Foods", "Motors", "Media",
                   "Robotics", "Energy", "Textiles", "Pharma"]
PROFESSIONS = ["physicist", "painter", "novelist", "engineer", "economist", "composer", "architect",
               "chemist", "historian", "sculptor", "mathematician", "film director", "botanist",
               "journalist", "cartographer"]
INDUSTRIES = {"Labs": "research", "Systems": "software", "Dynamics": "aerospace", "Works": "manufacturing",
              "Industries": "heavy industry", "Foods": "food processing", "Motors": "automobiles",
              "Media": "publishing", "Robotics": "robotics", "Energy": "energy", "Textiles": "textiles",
              "Pharma": "pharmaceuticals"}


@dataclass
class Country:
    name: str
    capital: str = ""


@dataclass
class City:
    name: str
    country: str


@dataclass
class University:
    name: str
    city: str
    founded: int


@dataclass
class Person:
    name: str
    born_in: str
    birth_year: int
    university: str
    profession: str


@dataclass
class Company:
    name: str
    founder: str
    headquarters: str
    founded: int
    industry: str


@dataclass
class World:
    seed: int
    countries: list[Country] = field(default_factory=list)
    cities: list[City] = field(default_factory=list)
    universities: list[University] = field(default_factory=list)
    people: list[Person] = field(default_factory=list)
    companies: list[Company] = field(default_factory=list)

    def index(self) -> dict[str, object]:
        """Every entity by name (names are unique across the world)."""
        out: dict[str, object] = {}
        for group in (self.countries, self.cities, self.universities, self.people, self.companies):
            for e in group:
                out[e.name] = e
        return out

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class _Names:
    """Unique syllable names; every name drawn is unique across the whole world."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.used: set[str] = set()

    def word(self, syllables: tuple[int, int] = (2, 3)) -> str:
        n = self.rng.randint(*syllables)
        w = "".join(self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) for _ in range(n))
        return (w + self.rng.choice(_CODAS)).capitalize()

    def unique(self, make) -> str:
        for _ in range(1000):
            name = make()
            low = name.lower()
            if low not in self.used and not any(low in u or u in low for u in self.used if len(u) > 3 and len(low) > 3 and " " not in u and " " not in low):
                self.used.add(low)
                return name
        raise RuntimeError("could not draw a unique name; enlarge the syllable inventory")


class _Pool:
    """A fixed inventory of name words (given names, family names, company and university stems):
    with ``size`` > 0 every name is a combination of pool words, as real names reuse words, so
    every name token is common and a new entity is a new combination of known tokens. With 0, every
    name word is drawn fresh (each entity's name is a token the model sees only with that entity)."""

    def __init__(self, names: _Names, size: int, syllables: tuple[int, int]):
        self.names, self.syllables = names, syllables
        self.words = [names.unique(lambda: names.word(syllables)) for _ in range(size)]

    def word(self) -> str:
        return self.names.rng.choice(self.words) if self.words else self.names.word(self.syllables)


def generate_world(cfg: WorldConfig) -> World:
    """Draw the whole graph from ``cfg.seed`` (deterministic)."""
    rng = random.Random(cfg.seed)
    names = _Names(rng)
    w = World(seed=cfg.seed)
    given, family = _Pool(names, cfg.name_pool, (1, 2)), _Pool(names, cfg.name_pool, (2, 3))
    stems = _Pool(names, cfg.name_pool, (2, 2))

    for _ in range(cfg.num_countries):
        w.countries.append(Country(names.unique(lambda: names.word((1, 2)) + rng.choice(_COUNTRY_SUFFIX))))
    for i in range(cfg.num_cities):
        country = w.countries[i % len(w.countries)] if i < len(w.countries) else rng.choice(w.countries)
        w.cities.append(City(names.unique(lambda: names.word((1, 2)) + rng.choice(_CITY_SUFFIX)), country.name))
    for c in w.countries:  # the first city drawn in each country is its capital
        c.capital = next(city.name for city in w.cities if city.country == c.name)
    for _ in range(cfg.num_universities):
        city = rng.choice(w.cities)
        form = rng.choice(_UNI_FORMS)
        w.universities.append(University(names.unique(lambda: form.format(n=stems.word())), city.name,
                                         rng.randint(1600, 1990)))
    for _ in range(cfg.num_people):
        name = names.unique(lambda: f"{given.word()} {family.word()}")
        w.people.append(Person(name, rng.choice(w.cities).name, rng.randint(1900, 1999),
                               rng.choice(w.universities).name, rng.choice(PROFESSIONS)))
    for _ in range(cfg.num_companies):
        suffix = rng.choice(_COMPANY_SUFFIX)
        founder = rng.choice(w.people)
        w.companies.append(Company(names.unique(lambda: f"{stems.word()} {suffix}"), founder.name,
                                   rng.choice(w.cities).name, rng.randint(founder.birth_year + 20, 2020),
                                   INDUSTRIES[suffix]))
    return w
