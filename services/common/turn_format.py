"""Writing the MemPO turn grammar (docs/algorithm.md, section 1): the one place that knows its layout.

    [<mem> ... </mem>]  <think> ... </think>  ( <search> query </search> | <answer> ... </answer> )

Used wherever mempo *produces* turns (the oracle agent's SFT data, the scorer's answer
continuation, tests); the rollout's parser reads the same tags. The observation after a search is
the next user message: ``<information>\\n...\\n</information>``.

    render_turn(mem="Ada was born in Kalton.", think="Now the country.", search="Kalton country")
    -> "<mem>\\nAda was born in Kalton.\\n</mem>\\n<think>\\nNow the country.\\n</think>\\n<search> Kalton country </search>"

``<mem>`` and ``<think>`` bodies go on their own lines; the action's argument sits inline between
spaces (``<search> query </search>``, ``<answer> text </answer>``, as Search-R1 writes them). The
space matters to a byte-level BPE: a name after a space is the same tokens as in the question and
in the passages (" Sudryl" -> "ĠSudryl"), while a name at the start of a line is different tokens
("S", "udryl"), which a small model then fails to copy (docs/experiments.md).
"""

from __future__ import annotations

TAGS = ("mem", "think", "search", "answer", "information")


def block(tag: str, body: str) -> str:
    if tag not in TAGS:
        raise ValueError(f"unknown tag {tag!r}")
    return f"<{tag}>\n{body.strip()}\n</{tag}>"


def inline(tag: str, body: str) -> str:
    """An action block with its argument between spaces: ``<search> query </search>``."""
    if tag not in TAGS:
        raise ValueError(f"unknown tag {tag!r}")
    return f"<{tag}> {body.strip()} </{tag}>"


def render_turn(think: str, *, mem: str | None = None, search: str | None = None, answer: str | None = None) -> str:
    """One assistant turn; exactly one of ``search`` / ``answer``."""
    if (search is None) == (answer is None):
        raise ValueError("a turn has exactly one action: search or answer")
    parts = [block("mem", mem)] if mem is not None else []
    parts.append(block("think", think))
    parts.append(inline("search", search) if search is not None else inline("answer", answer))
    return "\n".join(parts)


FINAL_THINK = "I have found everything the question needs."  # the <think> of the answering turn


def answer_continuation(answer: str = "{gold}") -> str:
    """The rest of the policy's answering turn after its ``</mem>`` block, with ``answer`` as the answer:
    the turn the oracle writes (so the SFT policy's own words) and the continuation the scorer scores
    after each context (``scorer.answer_template``'s default), from one place so the two cannot drift."""
    return "\n" + render_turn(FINAL_THINK, answer=answer)


def render_information(text: str) -> str:
    """The observation message that follows a search."""
    return block("information", text)
