"""bench/memclaims.py on hand-made logged groups: which answer lines of a memory are claims, which are
supported by what the episode had been shown before the block's turn, and the per-step summary."""

import json
import math

import pytest

from bench.memclaims import claims, judge_block, main, summarize

MEM = ("<mem>\nQ1: In which city is University of Cydro located?\n- University of Cydro is located in Rainisfield.\n"
       "- Answer: Rainisfield\nQ2: Who founded Thavon Energy?\n- Answer: Tiom Habrar\n</mem>")
GOLDS = [["Rainisfield"], ["Vesyx Gobrea"]]


def test_answer_lines_are_claims_of_their_question_section():
    assert claims(MEM) == [(0, "Rainisfield"), (1, "Tiom Habrar")]
    assert claims("<mem>\n- Answer: x\nQ1: q\n- Still needed: the founder.\n</mem>") == []  # no header, no answer


def test_a_claim_is_supported_only_by_what_was_shown_before_the_turn():
    shown = "Doc 1 (Title: University of Cydro) University of Cydro is a university located in Rainisfield."
    out = judge_block(MEM, GOLDS, shown)
    assert out == [{"q": 0, "supported": True, "right": True}, {"q": 1, "supported": False, "right": False}]
    # the second answer is right but was never shown: an unsupported right guess
    lucky = judge_block(MEM.replace("Tiom Habrar", "vesyx  GOBREA."), GOLDS, shown)
    assert lucky[1] == {"q": 1, "supported": False, "right": True}
    # a gold inside a longer word is not shown
    assert not judge_block(MEM, GOLDS, "Rainisfieldton is a city")[0]["supported"]


def _row(step, a_mem):
    turns = [{"mem": "", "observation": "located in Rainisfield.", "a_mem": None},
             {"mem": MEM, "observation": "Thavon Energy was founded by Vesyx Gobrea.", "a_mem": a_mem},
             {"mem": MEM.replace("Tiom Habrar", "Vesyx Gobrea"), "observation": "", "a_mem": -a_mem}]
    return {"step": step, "k": 2, "golds": GOLDS, "episodes": [{"turns": turns}]}


def test_summary_per_step_bucket(tmp_path, capsys):
    rows = [_row(1, 0.5), _row(2, 0.25)]
    (s,) = summarize(rows, buckets=1)
    # per row: turn 2 claims (supported, unsupported), turn 3 two supported claims
    assert s["steps"] == "1-2" and s["blocks"] == 4 and s["claims_per_block"] == 2.0
    assert s["unsupported_share"] == pytest.approx(2 / 8) and s["unsupported_right"] == 0.0
    assert s["a_mem_unsupported"] == pytest.approx(0.375) and s["a_mem_supported"] == pytest.approx(-0.375)
    assert len(summarize(rows, buckets=2)) == 2 and summarize([], 4) == []
    run = tmp_path / "run"
    run.mkdir()
    (run / "groups.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n{\"step\": 3, tru")
    assert main([str(run), "--buckets", "1", "--json", str(tmp_path / "o.json")]) == 0
    assert "| run | 1-2 | 4 | 2.00 | 0.250 |" in capsys.readouterr().out
    assert not math.isnan(json.loads((tmp_path / "o.json").read_text())[str(run)][0]["a_mem_supported"])
    with pytest.raises(SystemExit, match="not found"):
        main([str(tmp_path / "missing")])
