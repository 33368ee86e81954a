"""Every case of the turn grammar has its documented outcome (services/rollout/parser.py)."""

import pytest

from services.common.turn_format import render_turn
from services.rollout.parser import parse_turn

GOOD2 = "<mem>\nAda was born in Kalton.\n</mem>\n<think>\nNow the country.\n</think>\n<search>\nKalton country\n</search>"


def test_well_formed_search_and_answer():
    p = parse_turn(GOOD2, 2)
    assert p.format_ok and p.action == "search" and p.argument == "Kalton country"
    assert GOOD2[p.mem.start : p.mem.end] == "<mem>\nAda was born in Kalton.\n</mem>"
    assert GOOD2[p.action_block.start : p.action_block.end] == "<search>\nKalton country\n</search>"
    a = parse_turn(render_turn("done", mem="m", answer="Kroumia; 1961"), 3)
    assert a.format_ok and a.action == "answer" and a.argument == "Kroumia; 1961"
    first = parse_turn(render_turn("first", search="Ada Brenn born"), 1)
    assert first.format_ok and first.mem is None and first.action == "search"


@pytest.mark.parametrize("text,turn,action,problem", [
    ("<think>x</think><search>q</search>", 2, "search", "missing <mem>"),
    ("<mem>m</mem><think>x</think><search>q</search>", 1, "search", "<mem> on turn 1"),
    ("<mem>m</mem><search>q</search>", 2, "search", "missing <think>"),
    ("<think>x</think><mem>m</mem><search>q</search>", 2, "search", "out of order"),
    ("<mem>m <think>x</think></mem><think>y</think><search>q</search>", 2, "search", "nested tag inside <mem>"),
    ("<mem>a</mem><mem>b</mem><think>x</think><search>q</search>", 2, "search", "repeated <mem>"),
    ("<mem>m</mem><think>x</think>", 2, "invalid", "no action"),
    ("<mem>m</mem><think>x</think><search>  </search>", 2, "invalid", "empty search"),
    ("<mem>m</mem><think>x</think><answer>A</answer><answer>B</answer>", 2, "answer", "text after action"),
    ("<mem>m</mem><think>x</think><search>q</search> and more", 2, "search", "text after action"),
    ("hello <mem>m</mem><think>x</think><search>q</search>", 2, "search", "stray text"),
    ("<mem>m</mem><think>x</think></think><search>q</search>", 2, "search", "stray tag </think>"),
    ("<mem>remember this and then the output was cut", 2, "invalid", "unclosed <mem>"),
    ("<mem>m</mem><think>x</think><search>Kalton cou", 2, "invalid", "unclosed <search>"),
    ("", 2, "invalid", "no action"),
])
def test_malformed_turns(text, turn, action, problem):
    p = parse_turn(text, turn)
    assert p.action == action
    assert problem in p.problems, p.problems
    assert not p.format_ok


def test_several_answers_take_the_first_and_empty_answer_is_an_answer():
    p = parse_turn("<mem>m</mem><think>x</think><answer>A</answer><answer>B</answer>", 2)
    assert p.argument == "A"
    e = parse_turn("<mem>m</mem><think>x</think><answer> </answer>", 2)
    assert e.action == "answer" and e.argument == ""


def test_truncated_inside_mem_drops_the_block():
    p = parse_turn("<mem>half a mem", 3)
    assert p.mem is None and "missing <mem>" not in p.problems and "unclosed <mem>" in p.problems


def test_trailing_whitespace_after_action_is_fine():
    assert parse_turn(GOOD2 + "\n  ", 2).format_ok
