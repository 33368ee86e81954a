"""Writing the MemPO turn grammar (docs/algorithm.md, section 1): the one place that knows its layout.

    [<mem> ... </mem>]  <think> ... </think>  ( <search> query </search> | <answer> ... </answer> )

Used wherever mempo *produces* turns (the oracle agent's SFT data, the scorer's answer
continuation, tests); the rollout's parser reads the same tags. The observation after a search is
the next user message: ``<information>\\n...\\n</information>``.

    render_turn(mem="Ada was born in Kalton.", think="Now the country.", search="Kalton country")
    -> "<mem>\\nAda was born in Kalton.\\n</mem>\\n<think>\\nNow the country.\\n</think>\\n<search>\\nKalton country\\n</search>"
"""

from __future__ import annotations

TAGS = ("mem", "think", "search", "answer", "information")


def block(tag: str, body: str) -> str:
    if tag not in TAGS:
        raise ValueError(f"unknown tag {tag!r}")
    return f"<{tag}>\n{body.strip()}\n</{tag}>"


def render_turn(think: str, *, mem: str | None = None, search: str | None = None, answer: str | None = None) -> str:
    """One assistant turn; exactly one of ``search`` / ``answer``."""
    if (search is None) == (answer is None):
        raise ValueError("a turn has exactly one action: search or answer")
    parts = [block("mem", mem)] if mem is not None else []
    parts.append(block("think", think))
    parts.append(block("search", search) if search is not None else block("answer", answer))
    return "\n".join(parts)


def render_information(text: str) -> str:
    """The observation message that follows a search."""
    return block("information", text)
