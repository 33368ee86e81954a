"""Reading a memory's question sections: the grammar the oracle's SFT transcripts teach.

A ``<mem>`` block holds one section per question of the prompt (services/world/oracle.py writes it):
``Q<i>: <question>`` on its own line, then ``- `` lines of facts, ending ``- Answer: X`` or
``- Still needed: ...``. The scorer maps the sections to token positions for per-question credit
(``algorithm.mem_credit_scope=question``); the benches read claims from them. (Kept apart from
services/common/turn_format.py, which *writes* turns: the world's cache key hashes that module.)

    memory_sections("<mem>\\nQ1: Where?\\n- Answer: B\\nQ2: When?\\n</mem>")
    -> [(0, 6, 29), (1, 29, 39)]          # (question index from 0, start, end) character offsets
"""

from __future__ import annotations

import re

SECTION = re.compile(r"^Q(\d+):", re.M)  # a question section's header line
ANSWER_LINE = re.compile(r"^- Answer:\s*(.*?)\s*$", re.M)  # a section's closing claim


def memory_sections(memory: str) -> list[tuple[int, int, int]]:
    """(question index from 0, start, end) character offsets of every ``Q<i>:`` section of a memory
    text, header included; a section ends where the next begins, the last at ``</mem>`` (or the end)."""
    close = memory.rfind("</mem>")
    stop = close if close >= 0 else len(memory)
    heads = [h for h in SECTION.finditer(memory) if h.start() < stop]
    return [(int(h.group(1)) - 1, h.start(), nxt.start() if nxt else stop)
            for h, nxt in zip(heads, heads[1:] + [None])]
