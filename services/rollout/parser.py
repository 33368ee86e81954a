"""Parsing one assistant turn of the MemPO grammar, with a defined outcome for every malformation.

    [<mem> ... </mem>]  <think> ... </think>  ( <search> query </search> | <answer> ... </answer> )

``parse_turn(text, turn)`` returns a :class:`ParsedTurn`: the action, its argument, character
spans of the ``<mem>`` block and of the action block, and ``problems`` (empty = well formed).
Outcomes, case by case (tests/rollout/test_parser.py pins each):

==============================================  =============================================
case                                            outcome
==============================================  =============================================
well formed                                     action executed, ``problems == []``
``<mem>`` missing on turn >= 2                  action executed; problem ``missing <mem>``
``<mem>`` on turn 1                             block kept (span set); problem ``<mem> on turn 1``
``<think>`` missing                             action executed; problem ``missing <think>``
blocks out of order (think before mem, ...)     action executed; problem ``out of order``
a tag nested in another block                   blocks end at their own close tag; problem ``nested``
several ``<mem>`` / ``<think>`` blocks          the first counts; problem ``repeated``
no complete action block                        action ``invalid``; problem ``no action``
empty ``<search>`` (whitespace only)            action ``invalid``; problem ``empty search``
several action blocks (several ``<answer>``s)   the first complete one is the action; ``text after action``
non-space text after the action                 ignored; problem ``text after action``
non-space text outside blocks                   ignored; problem ``stray text``
cut off inside ``<mem>`` (no ``</mem>``)         block dropped (no span); problem ``unclosed <mem>``
cut off anywhere else (no closing action tag)   action ``invalid``; problem ``no action``
==============================================  =============================================

A turn is *format valid* when ``problems`` is empty; the outcome reward uses that. An empty
``<answer>`` is still an answer (it scores 0).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

BLOCK_TAGS = ("mem", "think", "search", "answer")
_TAG = re.compile(r"<(/?)(mem|think|search|answer|information)>")


@dataclass
class Block:
    tag: str
    start: int  # char offset of "<tag>"
    end: int  # char offset just after "</tag>"
    body: str


@dataclass
class ParsedTurn:
    action: str  # "search" | "answer" | "invalid"
    argument: str = ""  # the query or the answer, stripped
    mem: Optional[Block] = None
    think: Optional[Block] = None
    action_block: Optional[Block] = None
    problems: list[str] = field(default_factory=list)

    @property
    def format_ok(self) -> bool:
        return not self.problems


def _blocks(text: str, problems: list[str]) -> list[Block]:
    """Top-level blocks in order. A block runs from its open tag to the first matching close tag;
    other tags inside it make it ``nested``. An open tag with no close tag ends the scan."""
    blocks, pos = [], 0
    while True:
        m = _TAG.search(text, pos)
        if m is None:
            break
        if m.group(1) or m.group(2) == "information":
            problems.append(f"stray tag {m.group(0)}")
            pos = m.end()
            continue
        tag = m.group(2)
        close = text.find(f"</{tag}>", m.end())
        if close < 0:
            problems.append(f"unclosed <{tag}>")
            break
        body = text[m.end() : close]
        if _TAG.search(body):
            problems.append(f"nested tag inside <{tag}>")
        blocks.append(Block(tag, m.start(), close + len(tag) + 3, body))
        pos = close + len(tag) + 3
    return blocks


def parse_turn(text: str, turn: int) -> ParsedTurn:
    """Parse one assistant turn (``turn`` counts from 1)."""
    problems: list[str] = []
    blocks = _blocks(text, problems)
    action_idx = next((i for i, b in enumerate(blocks) if b.tag in ("search", "answer")), None)
    head = blocks if action_idx is None else blocks[:action_idx]
    out = ParsedTurn(action="invalid", problems=problems)

    for tag in ("mem", "think"):
        found = [b for b in head if b.tag == tag]
        if len(found) > 1:
            problems.append(f"repeated <{tag}>")
        if found:
            setattr(out, tag, found[0])
    if out.mem is None and turn >= 2 and "unclosed <mem>" not in problems:
        problems.append("missing <mem>")
    if out.mem is not None and turn == 1:
        problems.append("<mem> on turn 1")
    if out.think is None:
        problems.append("missing <think>")
    order = [b.tag for b in head if b.tag in ("mem", "think")]
    if order and order != sorted(order, key=("mem", "think").index):
        problems.append("out of order")

    covered = blocks[: (action_idx + 1) if action_idx is not None else len(blocks)]
    gaps, last = [], 0
    for b in covered:
        gaps.append(text[last : b.start])
        last = b.end
    if any(g.strip() for g in gaps):
        problems.append("stray text")

    if action_idx is None:
        problems.append("no action")
        return out
    act = blocks[action_idx]
    out.action_block = act
    if text[act.end :].strip():
        problems.append("text after action")
    argument = act.body.strip()
    if act.tag == "search" and not argument:
        problems.append("empty search")
        return out
    out.action, out.argument = act.tag, argument
    return out
