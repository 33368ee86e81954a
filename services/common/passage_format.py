"""How retrieved passages are shown to the agent inside ``<information>`` (Search-R1 style).

    format_passages([{"id": "3", "contents": "\\"Kalton\\"\\nKalton is a city."}])
    -> "Doc 1 (Title: Kalton) Kalton is a city."
"""

from __future__ import annotations

DEFAULT_DOC_FORMAT = "Doc {i} (Title: {title}) {text}"


def split_contents(contents: str) -> tuple[str, str]:
    """Search-R1 ``contents`` -> (title, text): the title is the first line, in double quotes."""
    head, _, text = contents.partition("\n")
    return head.strip().strip('"'), text.strip()


def format_passages(docs: list[dict], template: str = DEFAULT_DOC_FORMAT) -> str:
    """One line per document, numbered from 1; an empty list says so."""
    if not docs:
        return "No results found."
    lines = []
    for i, d in enumerate(docs, 1):
        title, text = split_contents(d["contents"])
        lines.append(template.format(i=i, title=title, text=text, id=d.get("id", "")))
    return "\n".join(lines)
