"""A table of named choices: the choices of one config field, which the field's validation, the code
that branches on it, and the docs all read (a leaf: the standard library only). The algorithm's rules
are tables whose entries carry their functions, each registered where it is defined
(services/algorithm/: ``@MEM_CREDITS.rule("loss_only", "...")``).

    MEM_CREDITS.names                  # ("difference", "loss_only"): the field's Literal
    MEM_CREDITS.check(cfg.mem_credit)  # the name, or a ValueError naming the field and its choices
    MEM_CREDITS.reference              # "difference": the reference implementation's choice
    MEM_CREDITS[name].fn               # the rule's function

Code that branches on a choice ends with ``raise TABLE.unknown(value)`` (or looks the rule up through
``check``), so a value that skipped validation (a section built with ``model_construct``, a hand-made
dict) fails instead of silently acting as one of the others. tests/algorithm/test_choices.py checks
every table against its config field and docs/algorithm.md.
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

    def rule(self, name: str, description: str):
        """A decorator registering its function as the choice ``name`` (``@TABLE.rule(name, description)``)."""
        def register(fn):
            self.add(name, description, fn)
            return fn
        return register

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

