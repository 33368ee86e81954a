"""The embedded world: deterministic, cached, well-formed, answerable, and solved by the oracle."""

import hashlib
import json
import random
import time

import pandas as pd
import pytest
from transformers import AutoTokenizer

from services.config import load_config
from services.common.jsonl import read_jsonl
from services.common.passage_format import split_contents
from services.common.paths import world_key
from services.search_tool.bm25_index import BM25Index
from services.world.build import build_world, load_manifest
from services.world.entities import generate_world
from services.world.oracle import BEHAVIOURS, OracleAgent
from services.world.questions import all_questions, questions_of
from services.world.relations import ENTITY_LIST, RELATIONS, page_text

SMALL = ["world.num_people=40", "world.num_companies=15", "world.num_cities=16", "world.num_universities=8",
         "world.train_questions=100", "world.test_questions=20", "world.oracle_trajectories=40",
         "world.tokenizer_vocab_size=600"]


def _hashes(path):
    return {p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file() and p.name != "build_log.json"}


def test_build_is_deterministic_and_cached(tmp_path):
    a = build_world(load_config(None, SMALL + [f"world.dir={tmp_path / 'a'}"]), progress=False)
    b = build_world(load_config(None, SMALL + [f"world.dir={tmp_path / 'b'}"]), progress=False)
    assert a.name == b.name  # the key does not depend on where the world is stored
    assert _hashes(a) == _hashes(b)
    stamp = (a / "manifest.json").stat().st_mtime_ns
    t0 = time.perf_counter()
    assert build_world(load_config(None, SMALL + [f"world.dir={tmp_path / 'a'}"]), progress=False) == a
    assert time.perf_counter() - t0 < 1.0
    assert (a / "manifest.json").stat().st_mtime_ns == stamp
    assert not [p for p in (tmp_path / "a").iterdir() if p.name.startswith(".tmp")]
    other = load_config(None, SMALL + ["world.seed=1"])
    assert world_key(other) != a.name


def test_build_under_a_minute(world):
    manifest = load_manifest(world)  # not counting the optional pretraining of the base model
    assert manifest["build_s"] - manifest["timings_s"].get("pretrain", 0.0) < 60
    assert manifest["counts"]["people"] >= 100 and manifest["counts"]["passages"] > 300


def test_corpus_is_search_r1_jsonl(world):
    rows = read_jsonl(world / "corpus.jsonl")
    assert len({r["id"] for r in rows}) == len(rows)
    for r in rows:
        assert set(r) == {"id", "contents"} and isinstance(r["id"], str)
        head = r["contents"].split("\n", 1)[0]
        assert head.startswith('"') and head.endswith('"') and "\n" in r["contents"]
    titles = {split_contents(r["contents"])[0] for r in rows}
    for e in json.loads((world / "world.json").read_text())["people"]:
        assert e["name"] in titles and f"{e['name']} Prize" in titles  # page + distractor


def test_question_sets_have_verl_layout(world, tiny_cfg):
    train = pd.read_parquet(world / "train.parquet")
    test = pd.read_parquet(world / "test.parquet")
    assert {"data_source", "prompt", "ability", "reward_model", "extra_info"} <= set(train.columns)
    row = train.iloc[1]
    assert [m["role"] for m in row["prompt"]] == ["system", "user"]
    assert row["prompt"][0]["content"] == tiny_cfg.rollout.system_prompt
    k = row["extra_info"]["k"]
    target = list(row["reward_model"]["ground_truth"]["target"])
    assert len(target) == 1 and target[0].count("; ") == k - 1
    assert row["prompt"][1]["content"].count("; ") >= k - 1
    assert set(train["extra_info"].map(lambda e: e["k"])) == set(tiny_cfg.world.train_objectives)
    assert set(test["extra_info"].map(lambda e: e["k"])) == set(tiny_cfg.world.test_objectives)
    hops = {h for e in train["extra_info"] for h in e["hops"]}
    assert hops == {1, 2}
    train_q = {q for e in train["extra_info"] for q in e["questions"]}
    test_q = {q for e in test["extra_info"] for q in e["questions"]}
    assert not train_q & test_q, "test questions leak into training"


def test_held_out_split_is_entity_disjoint(world):
    """No entity a held-out question asks about is named in any training question (or asked about
    in one), so held-out EM cannot come from answers recalled from training."""
    def asked(split):
        df = pd.read_parquet(world / f"{split}.parquet")
        return ({c[0]["subject"] for e in df["extra_info"] for c in json.loads(e["chains"])},
                [q for e in df["extra_info"] for q in e["questions"]])

    train_subjects, train_questions = asked("train")
    test_subjects, test_questions = asked("test")
    assert len(test_subjects) >= 20 and len(test_questions) >= 300
    assert not train_subjects & test_subjects
    named = [(name, q) for q in train_questions for name in test_subjects if name in q]
    assert not named, f"held-out entities named in training questions: {named[:3]}"
    oracle = read_jsonl(world / "oracle.jsonl")  # the SFT data asks only training questions
    assert not [name for r in oracle for name in test_subjects if name in r["messages"][1]["content"]]


def test_every_question_is_answerable_from_pages(tiny_cfg):
    """Walking a question's chain through the entity pages with the relation regexes gives its answer."""
    w = generate_world(tiny_cfg.world)
    pages = {e.name: page_text(w, kind, e) for kind, items in ENTITY_LIST.items() for e in items(w)}
    one, two = all_questions(w)
    for q in one + two:
        subject = q.hops[0].subject
        for hop in q.hops:
            subject = RELATIONS[hop.relation].extract(pages[subject], subject)
            assert subject == hop.object, (q.text, hop)
        assert subject == q.answer


def test_planted_first_hop_passage_retrieved(world):
    """The oracle's first query finds the planted page in the top 3 for 100 test questions."""
    index = BM25Index.load(world / "index" / "bm25")
    test = pd.read_parquet(world / "test.parquet").head(100)
    hits = 0
    for row in test.to_dict("records"):
        q = questions_of(row)[0]
        query = RELATIONS[q.hops[0].relation].query.format(s=q.hops[0].subject)
        top = index.search([query], 3)[0]
        hits += row["extra_info"]["planted"][0] in [d["id"] for d, _ in top]
    assert hits >= 95, f"recall@3 = {hits}/100"


@pytest.fixture(scope="module")
def agent(world, tiny_cfg):
    index = BM25Index.load(world / "index" / "bm25")
    return OracleAgent(lambda qs, k: [[d for d, _ in h] for h in index.search(qs, k)], topk=3,
                       max_turns=tiny_cfg.rollout.max_turns)


def _check_grammar(messages):
    assert [m["role"] for m in messages[:2]] == ["system", "user"]
    turns = messages[2::2]
    for i, m in enumerate(messages[2:]):
        assert m["role"] == ("assistant" if i % 2 == 0 else "user")
        if m["role"] == "user":
            assert m["content"].startswith("<information>\n") and m["content"].endswith("\n</information>")
    for t, m in enumerate(turns):
        text = m["content"]
        assert text.startswith("<mem>\n") == (t > 0), text  # no memory on turn 1, always after
        assert text.count("<think>") == 1 and text.count("</think>") == 1
        action = "answer" if t == len(turns) - 1 else "search"
        assert text.endswith(f"</{action}>") and text.count(f"<{action}>") == 1


def test_perfect_oracle_solves_training_prompts(world, agent, tiny_cfg):
    rows = pd.read_parquet(world / "train.parquet").head(60).to_dict("records")
    for row in rows:
        traj = agent.solve(questions_of(row), tiny_cfg.rollout.system_prompt, "perfect")
        _check_grammar(traj.messages)
        assert traj.em == 1.0, traj.messages[-1]["content"]
        assert traj.searches == sum(row["extra_info"]["hops"])  # one search per hop, no waste


def test_imperfect_behaviours_leave_room_to_improve(world, agent, tiny_cfg):
    rows = pd.read_parquet(world / "train.parquet").to_dict("records")
    two_hop = [r for r in rows if r["extra_info"]["k"] == 1 and r["extra_info"]["hops"] == [2]][:20]
    sp = tiny_cfg.rollout.system_prompt
    rng = random.Random(0)
    for row in two_hop:
        qs = questions_of(row)
        perfect = agent.solve(qs, sp, "perfect")
        early = agent.solve(qs, sp, "early_answer")
        redundant = agent.solve(qs, sp, "redundant")
        _check_grammar(early.messages)
        _check_grammar(redundant.messages)
        assert early.em == 0.0 and early.searches == 1  # answered one hop short
        assert redundant.searches == perfect.searches + 1 and redundant.em == 1.0
        forget = agent.solve(qs, sp, "forget", rng)
        _check_grammar(forget.messages)
        assert forget.searches >= perfect.searches
    data = [json.loads(line) for line in open(world / "oracle.jsonl")]
    assert {d["behaviour"] for d in data} == set(BEHAVIOURS)
    share = sum(d["behaviour"] != "perfect" for d in data) / len(data)
    assert abs(share - tiny_cfg.world.oracle_imperfect_share) < 0.08
    for d in data:
        _check_grammar(d["messages"])


def test_world_tokenizer(world):
    tok = AutoTokenizer.from_pretrained(world / "model")
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    specials = [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
    assert specials == [0, 1, 2]
    for text in ["<mem>\nAda was born in Kalton.\n</mem>", "里德学院 Reed College", "1961; Gerkville"]:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    ids = tok.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}],
                                  add_generation_prompt=True, tokenize=False)
    assert ids == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"
    enc = tok("<answer> Gerkville </answer>", return_offsets_mapping=True, add_special_tokens=False)
    assert enc["offset_mapping"][-1][1] == len("<answer> Gerkville </answer>")


def test_world_build_also_provides_the_qwen_tokenizer(qwen_tokenizer):
    assert qwen_tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [151643, 151644, 151645]
    assert qwen_tokenizer.encode("Hello world", add_special_tokens=False) == [9707, 1879]
