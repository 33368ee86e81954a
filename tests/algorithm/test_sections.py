"""The memory grammar's section parse (services/algorithm/sections.py)."""

from services.algorithm.sections import ANSWER_LINE, memory_sections


def test_sections_split_a_memory_by_question_header():
    memory = ("<mem>\n" + "Q1: Where?" + "\n- A is in B.\n- Answer: B\n"
              + "Q2: When?" + "\n- Still needed: the year.\n</mem>")
    got = memory_sections(memory)
    assert [q for q, _, _ in got] == [0, 1]
    first, second = (memory[a:b] for _, a, b in got)
    assert first == "Q1: Where?\n- A is in B.\n- Answer: B\n" and second == "Q2: When?\n- Still needed: the year.\n"
    assert [m.group(1) for m in ANSWER_LINE.finditer(first)] == ["B"] and not ANSWER_LINE.search(second)


def test_no_header_no_section_and_headers_only_at_line_start():
    assert memory_sections("<mem>\nnothing here Q1: inline\n</mem>") == []
    assert memory_sections("Q3: x") == [(2, 0, 5)]  # no tags: to the end of the text
