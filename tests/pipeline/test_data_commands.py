"""`mempo data`: FanOutQA as a question set with a generated corpus, k-objective composition with
entity-disjoint splits, and gold-known oracle transcripts that `mempo sft` reads (no Ray, no model)."""

import json

import pytest

from services.common.data import load_prompts, objectives_in
from services.pipeline.compose import compose
from services.pipeline.data_cli import main
from services.pipeline.fanout import corpus, dev_questions, single_questions
from services.pipeline.sft import load_transcripts
from services.pipeline.transcripts import solve
from services.rollout.settings import DEFAULT_SYSTEM_PROMPT

SYSTEM = DEFAULT_SYSTEM_PROMPT


def rows(path):
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def test_fanoutqa_dev_gives_single_questions_and_one_passage_per_evidence_page():
    dev = dev_questions()
    assert len(dev) == 310  # what the package ships
    singles = single_questions(dev)
    assert len(singles) > 1500 and len({s["id"] for s in singles}) == len(singles)
    assert all(len(s["answers"]) == 1 and s["answers"][0] and s["entity"] for s in singles)
    docs = corpus(singles)
    assert len(docs) == len({s["entity"] for s in singles})
    by_title = {d["contents"].split("\n")[0].strip('"'): d["contents"] for d in docs}
    for s in singles[:50]:  # every answer is stated in its page's passage
        assert s["answers"][0] in by_title[s["entity"]]


def _singles_file(tmp_path, n_entities=12, per_entity=3):
    path = tmp_path / "singles.jsonl"
    path.write_text("".join(json.dumps({"id": f"{e}-{j}", "question": f"Q {j} about E{e}?", "answers": [f"a{e}{j}"],
                                        "entity": f"E{e}"}) + "\n"
                            for e in range(n_entities) for j in range(per_entity)))
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_compose_makes_k_objective_tasks_with_entity_disjoint_splits(tmp_path, fmt):
    out = compose(_singles_file(tmp_path), tmp_path / "out", [1, 2, 3], train_per_k=10, test_per_k=4,
                  test_share=0.25, seed=1, fmt=fmt)
    train = load_prompts(out["train"], SYSTEM)
    test = load_prompts(out["test"], SYSTEM)
    assert [p.extra["k"] for p in train] == [1] * 10 + [2] * 10 + [3] * 10 and len(test) == 12
    assert objectives_in(out["test"]) == [1, 2, 3]
    ents = lambda ps: {e for p in ps for e in p.extra["entities"].split("; ")}  # noqa: E731
    assert ents(train) and ents(test) and not ents(train) & ents(test)  # no entity on both sides
    assert all(len(set(p.extra["entities"].split("; "))) == p.extra["k"] for p in train)  # k different ones
    t = next(p for p in train if p.extra["k"] == 3)
    assert t.messages[1].content.count("; ") == 2 and len(t.golds) == 3 and t.messages[0].content == SYSTEM
    again = compose(_singles_file(tmp_path), tmp_path / "again", [1, 2, 3], 10, 4, 0.25, 1, fmt)
    assert load_prompts(again["train"], SYSTEM) == train  # seeded


def test_compose_says_when_too_few_entities_make_a_task(tmp_path):
    with pytest.raises(ValueError, match="test: 1 entities cannot make a task of 2"):
        compose(_singles_file(tmp_path, n_entities=4), tmp_path / "o", [2], 5, 5, test_share=0.25)


def test_the_gold_known_oracle_writes_mempo_turns_that_sft_reads(tmp_path):
    passages = {"E1": {"id": "1", "contents": '"E1"\nQ about E1: Oslo.'},
                "E2": {"id": "2", "contents": '"E2"\nQ about E2: 1911.'}}
    search = lambda q: [passages["E2"], passages["E1"]] if "E2" in q else [passages["E1"]]  # noqa: E731
    t = solve(["Q about E1?", "Q about E2?"], [["Oslo"], ["1911"]], ["E1", "E2"], SYSTEM, search,
              "Doc {i} (Title: {title}) {text}", max_turns=8)
    roles = [m["role"] for m in t["messages"]]
    assert t["em"] == 1.0 and roles == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    assert "<mem>" not in t["messages"][2]["content"] and "<mem>" in t["messages"][4]["content"]
    assert "- Answer: Oslo" in t["messages"][4]["content"] and "<answer> Oslo; 1911 </answer>" in t["messages"][-1]["content"]
    missing = solve(["Q about E3?"], [["Rome"]], [], SYSTEM, lambda q: [passages["E1"]], "{text}", max_turns=8)
    assert missing["em"] == 0.0 and "unknown" in missing["messages"][-1]["content"]
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps(t) + "\n" + json.dumps(missing) + "\n")
    kept = load_transcripts(path, 1.0, "Another system prompt.")
    assert len(kept) == 1 and kept[0][0] == {"role": "system", "content": "Another system prompt."}


def test_sft_reads_chat_formats_with_or_without_a_system_message(tmp_path):
    turn = "<think>\nok\n</think>\n<answer> Oslo </answer>"
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"messages": [{"role": "user", "content": "Capital of Norway?"}, {"role": "assistant", "content": turn}]},
        {"messages": [{"role": "system", "content": "old"}, {"role": "user", "content": "Q?"},
                      {"role": "assistant", "content": turn}], "em": 0.0},
        {"conversations": [{"from": "human", "value": "Q2?"}, {"from": "gpt", "value": turn}]},
    ]) + "\n")
    kept = load_transcripts(path, 1.0, SYSTEM)
    assert [[m["role"] for m in t] for t in kept] == [["system", "user", "assistant"]] * 2
    assert all(t[0]["content"] == SYSTEM for t in kept) and kept[1][1]["content"] == "Q2?"
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": [{"role": "assistant", "content": turn}]}) + "\n")
    with pytest.raises(ValueError, match=r"train.sft_data: .*bad.jsonl line 1: needs 'messages'"):
        load_transcripts(tmp_path / "bad.jsonl", 1.0, SYSTEM)


def test_the_data_command_runs_fanoutqa_then_compose(tmp_path, capsys):
    assert main(["fanoutqa", str(tmp_path)]) == 0
    assert main(["compose", str(tmp_path / "questions.jsonl"), "--out", str(tmp_path), "--ks", "1,2",
                 "--train-per-k", "5", "--test-per-k", "3"]) == 0
    assert len(rows(tmp_path / "train.jsonl")) == 10 and len(rows(tmp_path / "test.jsonl")) == 6
    assert main(["compose", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path)]) == 2
    assert "nope.jsonl does not exist" in capsys.readouterr().err
