"""bench/memcounterfactual.py's edits (no model): which question sections are open, how an open one is
closed with an answer, and which logged blocks qualify (a supported claim and an open, never-shown
question)."""

from bench.memcounterfactual import candidates, close_sections, inner, open_sections

MEM = ("Q1: In which city is University of Cydro located?\n- University of Cydro is located in Rainisfield.\n"
       "- Answer: Rainisfield\nQ2: In which city was the founder of Thavon Energy born?\n"
       "- Thavon Energy was founded by Vesyx Gobrea.\n- Still needed: the birthplace of Vesyx Gobrea.")


def test_open_sections_and_closing_them_leaves_the_rest_as_it_was():
    assert open_sections(MEM) == [1]
    closed = close_sections(MEM, {1: "Foo Bar"})
    assert closed == MEM.replace("- Still needed: the birthplace of Vesyx Gobrea.", "- Answer: Foo Bar")
    assert open_sections(closed) == []
    assert close_sections(MEM, {}) == MEM
    assert close_sections("Q1: q\n", {0: "X"}) == "Q1: q\n- Answer: X\n"  # a header alone gets an answer line
    assert inner("<mem>\n" + MEM + "\n</mem>") == MEM


def test_candidates_need_a_supported_claim_and_an_open_question_never_shown():
    shown_q1 = "University of Cydro is a university located in Rainisfield."
    row = {"step": 1, "question": "q1?; q2?", "golds": [["Rainisfield"], ["Giosoushaven"]], "episodes": [{"turns": [
        {"mem": "", "observation": shown_q1},
        {"mem": "<mem>\n" + MEM + "\n</mem>", "observation": "Giosoushaven is a city."},
        {"mem": "<mem>\n" + MEM + "\n</mem>", "observation": ""}]}]}
    (b,) = candidates([row], steps=1)  # the third block's open question had been shown: not unfounded to close
    assert b["open"] == [1] and b["shown"] == [0] and b["memory"] == MEM
    assert candidates([row], steps=0) == []
