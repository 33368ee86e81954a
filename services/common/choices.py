"""The named choices of the algorithm's settings: one table per config field, which the field's
validation, the code that branches on it, and the docs all read (a leaf: the standard library only).

    MEM_CREDITS.names                  # ("difference", "loss_only"): the field's Literal
    MEM_CREDITS.check(cfg.mem_credit)  # the name, or a ValueError naming the field and its choices
    MEM_CREDITS.reference              # "difference": the reference implementation's choice

Code that branches on a choice ends with ``raise TABLE.unknown(value)``, so a value that skipped
validation (a section built with ``model_construct``, a hand-made dict) fails instead of silently
acting as one of the others. The memory reward's filters and averages are tables of the same kind
whose entries carry their functions (services/common/memory_reward.py ``FILTERS``, ``AVERAGES``).
tests/common/test_choices.py checks every table against its config field and docs/algorithm.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class Choice:
    """One named choice: a one-line description and, in a registry of rules, its function."""

    name: str
    description: str
    fn: Optional[Callable] = None


class Choices(dict):
    """name -> :class:`Choice`, in the order given: the choices of the config field ``field``, of which
    ``reference`` is the reference implementation's."""

    def __init__(self, field: str, reference: str, *choices: tuple[str, str]):
        super().__init__()
        self.field, self.reference = field, reference
        for name, description in choices:
            self.add(name, description)

    def add(self, name: str, description: str, fn: Optional[Callable] = None) -> Choice:
        if name in self:
            raise ValueError(f"{self.field}: {name!r} is registered twice")
        self[name] = Choice(name, description, fn)
        return self[name]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self)

    def unknown(self, value) -> ValueError:
        return ValueError(f"{self.field}: unknown choice {value!r}; choose from {', '.join(self)}")

    def check(self, value: str) -> str:
        if value not in self:
            raise self.unknown(value)
        return value


MEM_POOLINGS = Choices(
    "algorithm.mem_pooling", "prompt",
    ("prompt", "every <mem> block of the prompt's group in one pool (the reference)"),
    ("prompt_turn", "one pool per (prompt, turn number)"),
    ("prompt_seen", "one pool per (prompt, the tool responses shown before the block, order ignored)"),
)

MEM_CREDITS = Choices(
    "algorithm.mem_credit", "difference",
    ("difference", "R_mem = P_mem - P_full (the reference)"),
    ("loss_only", "min(P_mem - P_full, 0): a memory is charged for what it lost, never credited beyond the full "
                  "history"),
)

MEM_CREDIT_SCOPES = Choices(
    "algorithm.mem_credit_scope", "block",
    ("block", "A_mem of the block's R_mem on every token of the block (the reference)"),
    ("question", "each question's section of the memory gets the A_mem of that question's own R_mem"),
)

SCORED_ANSWERS = Choices(
    "scorer.scored_answers", "all",
    ("all", "every question's answer (the reference)"),
    ("shown", "only the answers the episode's observations had shown before the block's turn"),
)
