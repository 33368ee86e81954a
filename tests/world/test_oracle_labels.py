"""The oracle's ground-truth memory labels (services/world/oracle.py TurnLabel), checked by hand
against the text each memory really holds: a keep block states everything shown, a lose block lacks
exactly what its label says it lost (an answer, a bridge entity) or carries a distractor's value."""

import json
import random

import pandas as pd
import pytest

from services.common.passage_format import split_contents
from services.search_tool.bm25_index import BM25Index
from services.world.oracle import BEHAVIOURS, DISTRACTOR_VALUES, LOSSY_BEHAVIOURS, OracleAgent
from services.world.questions import questions_of
from services.world.relations import RELATIONS


@pytest.fixture(scope="module")
def agent(world, tiny_cfg):
    index = BM25Index.load(world / "index" / "bm25")
    return OracleAgent(lambda qs, k: [[d for d, _ in h] for h in index.search(qs, k)], topk=tiny_cfg.search.topk,
                       doc_format=tiny_cfg.search.doc_format, max_turns=tiny_cfg.rollout.max_turns)


@pytest.fixture(scope="module")
def rows(world):
    return pd.read_parquet(world / "train.parquet").to_dict("records")


def _memory(traj, label) -> str:
    """The body of the <mem> block of the label's turn."""
    text = traj.messages[2 * label.turn]["content"]
    return text[text.index("<mem>\n") + 6:text.index("\n</mem>")]


def _facts(mem: str) -> str:
    """The memory without its question lines: the facts it states (and what is still needed)."""
    return "\n".join(line for line in mem.split("\n") if not line.startswith("Q"))


def _observation_before(traj, label) -> str:
    return traj.messages[2 * label.turn - 1]["content"]


def _first_loss(agent, rows, sp, behaviour, kind, k=None):
    """(trajectory, index of its first lose label, questions) of the first prompt and seed that lose ``kind``,
    where no other text of the prompt names the lost value (so the text check is clean)."""
    for row in rows[:300]:
        if k is not None and row["extra_info"]["k"] != k:
            continue
        qs = questions_of(row)
        for seed in range(4):
            traj = agent.solve(qs, sp, behaviour, random.Random(seed))
            for i, lab in enumerate(traj.labels):
                if lab.lost and lab.lost[0].kind == kind:
                    value = lab.lost[0].fact.value
                    others = [f.value for f in lab.shown if f != lab.lost[0].fact]
                    if not any(value in o for o in others) and value not in "; ".join(q.text for q in qs):
                        return traj, i, qs
    raise AssertionError(f"no {behaviour} episode lost a {kind} in 300 prompts x 4 seeds")


def test_perfect_memories_keep_everything_shown(agent, rows, tiny_cfg):
    sp = tiny_cfg.rollout.system_prompt
    for row in rows[:40]:
        qs = questions_of(row)
        traj = agent.solve(qs, sp, "perfect")
        assert len(traj.labels) == traj.turns == len(traj.messages[2::2])
        first, *rest = traj.labels
        assert not first.has_mem and not first.shown and first.label == "none"
        for prev, lab in zip(traj.labels, rest):
            assert lab.has_mem and not lab.lost and lab.kept == lab.shown
            assert len(lab.shown) == len(prev.shown) + 1  # one search per hop, each read once
            new = lab.shown[-1]
            assert new.value in _observation_before(traj, lab)  # the history did show it
            mem = _memory(traj, lab)
            for f in lab.shown:
                assert f.value in _facts(mem), (f, mem)
        # by the answer, the history had shown every hop object of every question, roles right
        expect = {(i, h, hop.object, "answer" if h == len(q.hops) - 1 else "bridge")
                  for i, q in enumerate(qs) for h, hop in enumerate(q.hops)}
        assert {(f.question, f.hop, f.value, f.role) for f in traj.labels[-1].shown} == expect
        assert traj.labels[-1].label == "keep"


def test_lose_answer_block_lacks_exactly_that_answer(agent, rows, tiny_cfg):
    traj, i, qs = _first_loss(agent, rows, tiny_cfg.rollout.system_prompt, "lose_answer", "answer", k=2)
    lab, prev = traj.labels[i], traj.labels[i - 1]
    (loss,) = lab.lost
    q = qs[loss.fact.question]
    assert loss.how == "dropped" and loss.fact.role == "answer" and loss.fact.value == q.answer
    assert loss.fact in lab.shown and loss.fact not in prev.shown  # read in the observation just before
    assert loss.fact.value in _observation_before(traj, lab)
    mem = _memory(traj, lab)
    assert loss.fact.value not in mem  # lost ...
    for f in lab.kept:  # ... and nothing else
        assert f.value in _facts(mem)
    assert set(lab.kept) == set(lab.shown) - {loss.fact}
    later = traj.labels[i + 1:]
    assert later and later[-1].label == "keep" and traj.em == 1.0  # searched again, found again
    assert traj.searches == sum(len(x.hops) for x in qs) + 1


def test_lose_bridge_block_lacks_the_bridge_entity(agent, rows, tiny_cfg):
    traj, i, qs = _first_loss(agent, rows, tiny_cfg.rollout.system_prompt, "lose_bridge", "bridge")
    lab = traj.labels[i]
    (loss,) = lab.lost
    q = qs[loss.fact.question]
    assert len(q.hops) == 2 and loss.fact.hop == 0 and loss.fact.value == q.hops[0].object != q.answer
    assert loss.how == "dropped" and loss.fact.value in _observation_before(traj, lab)
    mem = _memory(traj, lab)
    assert loss.fact.value not in mem
    assert f"- Still needed: {RELATIONS[q.hops[0].relation].phrase.format(s=q.hops[0].subject)}." in mem  # hop 1 again
    for f in lab.kept:
        assert f.value in _facts(mem)
    assert traj.labels[-1].label == "keep" and traj.em == 1.0


def test_distractor_block_carries_the_distractors_value(agent, rows, tiny_cfg):
    traj, i, qs = _first_loss(agent, rows, tiny_cfg.rollout.system_prompt, "distractor", "distractor")
    lab = traj.labels[i]
    (loss,) = lab.lost
    assert loss.how == "replaced" and loss.replaced_by and loss.replaced_by != loss.fact.value
    mem = _memory(traj, lab)
    assert loss.replaced_by in _facts(mem) and loss.fact.value not in _facts(mem)
    for f in lab.kept:
        assert f.value in _facts(mem)
    # the substitute comes from a passage of the same observation that is not the subject's page
    subject = qs[loss.fact.question].hops[loss.fact.hop].subject
    docs = [line for line in _observation_before(traj, lab).split("\n") if line.startswith("Doc ")]
    assert any(loss.replaced_by in d and f"(Title: {subject})" not in d for d in docs)
    assert any(f"(Title: {subject})" in d and loss.fact.value in d for d in docs)
    assert all(x.lost for x in traj.labels[i:])  # never read again: every later memory has it wrong


def test_forget_is_labelled_and_lossy_behaviours_stay_out_of_the_sft_mix(agent, rows, world, tiny_cfg):
    assert not set(LOSSY_BEHAVIOURS) & set(BEHAVIOURS)
    data = [json.loads(line) for line in open(world / "oracle.jsonl")]
    assert {d["behaviour"] for d in data} <= set(BEHAVIOURS)
    assert "labels" not in data[0]  # the SFT rows keep their layout
    sp, lost = tiny_cfg.rollout.system_prompt, 0
    for row in rows[:20]:
        traj = agent.solve(questions_of(row), sp, "forget", random.Random(0))
        for lab in traj.labels:
            lost += bool(lab.lost)
            for loss in lab.lost:
                assert loss.how == "dropped" and loss.fact.value not in _facts(_memory(traj, lab))
    assert lost > 0


def test_distractor_patterns_read_every_distractor_passage(world):
    """Every distractor passage of the corpus states a value the oracle's table can read, and it is an
    entity of the world or a year (services/world/corpus.py and DISTRACTOR_VALUES agree)."""
    import re

    graph = json.loads((world / "world.json").read_text())
    names = {e["name"] for kind in ("countries", "cities", "universities", "people", "companies") for e in graph[kind]}
    seen = 0
    for line in open(world / "corpus.jsonl"):
        title, text = split_contents(json.loads(line)["contents"])
        if title in names:
            continue
        seen += 1
        values = [m.group("o").strip() for pats in DISTRACTOR_VALUES.values() for p in pats
                  for m in [re.search(p, text)] if m]
        assert values and all(v in names or v.isdigit() for v in values), (title, text, values)
    assert seen > 100

