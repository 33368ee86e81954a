"""Counterfactual renaming of SFT transcripts (services/world/name_swap.py)."""

import random

import pytest

from services.world.name_swap import NameSwapper

PEOPLE = ["Krind Chakrin", "Krind Pedousios", "Domis Chakrin", "Ada Brenn"]
COMPANIES = ["Raichom Energy", "Zentrix Labs"]
UNIVERSITIES = ["University of Sheachol", "Zikraith University"]
TAKEN = set(PEOPLE + COMPANIES + UNIVERSITIES + ["Pigriosford", "Kaltonia"])


def swapper() -> NameSwapper:
    return NameSwapper(PEOPLE, COMPANIES, UNIVERSITIES, TAKEN)


def transcript() -> list[dict]:
    return [
        {"role": "system", "content": "Krind Chakrin is never renamed here."},
        {"role": "user", "content": "Who founded Raichom Energy?; Where did Krind Chakrin study?"},
        {"role": "assistant", "content": "<search> Raichom Energy founded by </search>"},
        {"role": "user", "content": "<information>Raichom Energy is an energy company founded in 1950 by "
                                    "Krind Chakrin. The Krind Chakrin Prize is held at University of Sheachol. "
                                    "Krind Chakrins and XKrind Chakrin are not names.</information>"},
        {"role": "assistant", "content": "<mem>Raichom Energy was founded by Krind Chakrin.</mem>"
                                         "<answer> Krind Chakrin; Zikraith University </answer>"},
    ]


def test_renaming_is_consistent_fresh_and_keeps_kinds():
    msgs = transcript()
    out = swapper().rename(msgs, random.Random(0))
    assert out[0] == msgs[0]  # the system prompt is left alone
    assert msgs == transcript()  # the input is not modified
    text = " ".join(m["content"] for m in out[1:])
    for name in PEOPLE + COMPANIES + UNIVERSITIES:
        assert f" {name} " not in f" {text} ".replace(";", " ").replace(".", " ").replace("?", " ")
    # Krind Chakrin is renamed to one fresh person everywhere it appears as a whole name
    person = out[1]["content"].split("Where did ")[1].split(" study?")[0]
    assert person not in TAKEN and len(person.split()) == 2
    assert person.split()[0] in {"Krind", "Domis", "Ada"} and person.split()[1] in {"Chakrin", "Pedousios", "Brenn"}
    assert out[4]["content"].count(person) == 2 and out[3]["content"].count(person) == 2
    # a company keeps its suffix (the industry its page states), a university its form
    company = out[1]["content"].split("Who founded ")[1].split("?")[0]
    assert company.endswith(" Energy") and company not in TAKEN
    assert "University of " in out[3]["content"] and out[4]["content"].rstrip(" </answer>").endswith("University")
    # names glued to other word characters are not names
    assert "Krind Chakrins" in out[3]["content"] and "XKrind Chakrin" in out[3]["content"]


def test_the_same_seed_renames_the_same_way():
    a = swapper().rename(transcript(), random.Random(7))
    b = swapper().rename(transcript(), random.Random(7))
    assert a == b


def test_an_exhausted_inventory_is_a_clear_error():
    small = NameSwapper(["Ada Brenn"], [], [], {"Ada Brenn"})
    with pytest.raises(ValueError, match="inventory is too small"):
        small.rename([{"role": "system", "content": ""}, {"role": "user", "content": "Ada Brenn?"}], random.Random(0))
