"""The long-horizon config (deploy/configs/long.yaml) at a tiny size: its world trains every k it names,
the oracle finishes every held-out k within the turn limit, and the limits do what the config says
(no oracle turn over rollout.max_response_tokens, the memory context within the context limit at
every k, the full history over it at k=8)."""

import json
from pathlib import Path

import pytest

from services.config import load_config
from services.world.build import build_world
from services.world.lengths import episode_lengths, lengths_table, oracle_lengths

ROOT = Path(__file__).resolve().parents[2]
LONG = str(ROOT / "deploy" / "configs" / "long.yaml")
SMALL = ["world.num_people=40", "world.num_companies=15", "world.num_cities=16", "world.num_universities=8",
         "world.train_questions=80", "world.test_questions=12", "world.oracle_trajectories=48",
         "world.tokenizer_vocab_size=1200", "world.pretrain_tokens=0"]


@pytest.fixture(scope="module")
def long_world(tmp_path_factory):
    cfg = load_config(LONG, SMALL + [f"world.dir={tmp_path_factory.mktemp('long')}"])
    return cfg, build_world(cfg, progress=False)


def test_the_long_config_trains_every_k_up_to_four_and_holds_out_eight():
    cfg = load_config(LONG)
    assert sorted(set(cfg.world.train_objectives)) == [1, 2, 3, 4]
    assert cfg.world.train_objectives.count(4) > cfg.world.train_objectives.count(1)  # weighted towards the harder
    assert cfg.world.test_objectives == [1, 2, 4, 8]
    assert cfg.world.oracle_max_turns == cfg.rollout.max_turns  # the cold start and the agent share the limit
    assert cfg.world.distractors_per_entity >= 2


def test_the_long_world_has_sft_transcripts_for_every_training_k_and_limits_that_bind_only_the_full_history(
        long_world):
    cfg, world = long_world
    oracle = [json.loads(line) for line in (world / "oracle.jsonl").read_text().splitlines()]
    assert {r["k"] for r in oracle} == {1, 2, 3, 4}
    assert {r["behaviour"] for r in oracle} > {"perfect"}  # imperfect ones too (forget among them, by seed)
    rows = oracle_lengths(cfg, world, per_k=12)
    assert list(rows) == [1, 2, 4, 8]
    for k, row in rows.items():
        assert row["finished"] == 1.0 and row["em"] == 1.0, (k, row)  # solvable within the turn limit
        assert row["turn_over"] == 0.0 and row["memory_over"] == 0.0, (k, row)  # the agent can write and see it
    assert rows[8]["full_over"] >= 0.9  # the whole history does not fit at k=8 ...
    assert rows[8]["full_history"] > 3 * rows[8]["memory_peak"]  # ... while one memory-context turn does
    assert rows[1]["full_over"] == 0.0
    assert rows[8]["turns"] > rows[4]["turns"] > rows[1]["turns"]
    table = lengths_table(rows, cfg)
    assert "| 8 | 1.00 | 1.00 |" in table and "rollout.max_context_tokens 2048" in table


def test_episode_lengths_count_the_memory_rule_and_the_whole_history():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a1"}, {"role": "user", "content": "o1"},
            {"role": "assistant", "content": "a2 a2"}, {"role": "user", "content": "o2"},
            {"role": "assistant", "content": "a3"}]

    def count(messages, bare=False):  # one token per word, one per message of framing
        return sum(len(m["content"].split()) + (0 if bare else 1) for m in messages)

    out = episode_lengths(msgs, count)
    # turn 2's context: s, q, a1, o1, a2 (2+2+2+2+3); turn 3's: s, q, a2, o2, a3 (2+2+3+2+2); turn 1's: 6
    assert out == {"turns": 3, "longest_turn": 2, "full_history": 15, "memory_peak": 11}
    with pytest.raises(ValueError, match="at least one assistant turn"):
        episode_lengths(msgs[:2], count)
