"""Question sets in every accepted format become the same prompts under MemPO's instructions
(services/common/data.py), and a bad file names the setting, the row and what is missing."""

import json

import pandas as pd
import pytest

from services.common.data import DataError, load_prompts, objectives_in, read_rows

SYSTEM = "You are a MemPO agent. <mem> ... </mem>"
# Search-R1's published layout (scripts/data_process/nq_search.py): its instructions and the question in
# one user message, the answers in reward_model, the original columns kept beside them.
SEARCH_R1_PREFIX = ("Answer the given question. You must conduct reasoning inside <think> and </think> first every "
                    "time you get new information. ... If you find no further external knowledge needed, you can "
                    "directly provide the answer inside <answer> and </answer>. For example, <answer> Beijing "
                    "</answer>. Question: ")


def search_r1_row(i: int, question: str, answers: list[str], keep_columns: bool = True) -> dict:
    row = {"data_source": "nq", "prompt": [{"role": "user", "content": SEARCH_R1_PREFIX + question + "\n"}],
           "ability": "fact-reasoning", "reward_model": {"style": "rule", "ground_truth": {"target": answers}},
           "extra_info": {"split": "train", "index": i}}
    if keep_columns:
        row.update(id=f"train_{i}", question=question, golden_answers=answers)
    return row


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("keep_columns", [True, False])
def test_search_r1_parquet_as_published_gets_mempo_instructions_and_its_bare_question(tmp_path, keep_columns):
    path = tmp_path / "nq.parquet"
    pd.DataFrame([search_r1_row(0, "who wrote hamlet?", ["Shakespeare", "William Shakespeare"], keep_columns),
                  search_r1_row(1, "capital of peru?", ["Lima"], keep_columns)]).to_parquet(path)
    prompts = load_prompts(path, SYSTEM)
    assert [(m.role, m.content) for m in prompts[0].messages] == [("system", SYSTEM), ("user", "who wrote hamlet?")]
    assert prompts[0].golds == [["Shakespeare", "William Shakespeare"]] and prompts[1].golds == [["Lima"]]
    assert prompts[0].uid == "train-0" and prompts[0].extra["k"] == 1 and prompts[0].data_source == "nq"
    assert objectives_in(path) == [1]


def test_plain_jsonl_single_and_multi_objective_rows(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [
        {"id": "a", "question": "Who founded Acme?", "answers": ["Ann Lee"]},
        {"id": "b", "question": "Year of the Acme fire?", "golden_answers": ["1911", "in 1911"]},
        {"id": "c", "question": ["Who founded Acme?", "Where is Acme based?"], "answers": [["Ann Lee"], ["Oslo"]],
         "entities": ["Acme", "Acme"]},
        {"id": "d", "question": ["Q1?", "Q2?", "Q3?"], "answers": ["x", "y", "z"]},  # one answer per question
    ])
    prompts = load_prompts(path, SYSTEM)
    assert [p.extra["k"] for p in prompts] == [1, 1, 2, 3]
    assert prompts[1].golds == [["1911", "in 1911"]]
    assert prompts[2].messages[1].content == "Who founded Acme?; Where is Acme based?"
    assert prompts[2].golds == [["Ann Lee"], ["Oslo"]] and prompts[2].extra["entities"] == "Acme; Acme"
    assert prompts[3].golds == [["x"], ["y"], ["z"]]
    assert [p.uid for p in load_prompts(path, SYSTEM, k=1)] == ["row-a", "row-b"]
    assert objectives_in(path) == [1, 2, 3]
    assert len(load_prompts(path, SYSTEM, limit=2)) == 2


def test_a_rows_own_system_message_is_replaced(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"prompt": [{"role": "system", "content": "Be brief."},
                                                          {"role": "user", "content": "Who founded Acme?"}],
                                               "reward_model": {"ground_truth": {"target": "Ann Lee"}}}])
    (p,) = load_prompts(path, SYSTEM)
    assert [(m.role, m.content) for m in p.messages] == [("system", SYSTEM), ("user", "Who founded Acme?")]
    assert p.golds == [["Ann Lee"]]


@pytest.mark.parametrize("rows, message", [
    ([{"question": "Who?"}], r"data: .*q.jsonl row 1: no answers"),
    ([{"answers": ["x"]}], r"row 1: no question"),
    ([{"question": "ok?", "answers": ["x"]}, {"question": ["a?", "b?"], "answers": [["x"]]}],
     r"row 2: 2 question\(s\) but answers for 1"),
])
def test_a_row_missing_its_question_or_answers_is_named(tmp_path, rows, message):
    path = write_jsonl(tmp_path / "q.jsonl", rows)
    with pytest.raises(DataError, match=message):
        load_prompts(path, SYSTEM)


def test_unreadable_files_name_the_setting(tmp_path):
    with pytest.raises(DataError, match=r"train.data: .*missing.jsonl does not exist"):
        read_rows(tmp_path / "missing.jsonl", "train.data")
    (tmp_path / "q.csv").write_text("question,answer\n")
    with pytest.raises(DataError, match=r"eval.data: .*q.csv is neither .parquet nor .jsonl"):
        read_rows(tmp_path / "q.csv", "eval.data")
    (tmp_path / "bad.jsonl").write_text('{"question": "a?", "answers": ["x"]}\nnot json\n')
    with pytest.raises(DataError, match=r"bad.jsonl line 2 is not JSON"):
        read_rows(tmp_path / "bad.jsonl")


def test_prompts_per_k_defaults_to_the_files_k_values_and_names_them_for_a_missing_one(tmp_path):
    from services.common.data import prompts_per_k

    path = write_jsonl(tmp_path / "t.jsonl", [{"question": "a?", "answers": ["x"]},
                                              {"question": ["a?", "b?"], "answers": [["x"], ["y"]]}])
    assert {k: len(v) for k, v in prompts_per_k(path, SYSTEM, []).items()} == {1: 1, 2: 1}
    with pytest.raises(DataError, match=r"no held-out prompts with k in \[4\] .*its rows have k in \[1, 2\]"):
        prompts_per_k(path, SYSTEM, [1, 4])
