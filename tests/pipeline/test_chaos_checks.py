"""mempo chaos's plan and invariant checks, on records written by hand (each check made to fail once)."""

import json
from collections import Counter

import pytest

from services.learner.ledger import Ledger, read
from services.pipeline import chaos_checks as cc
from services.pipeline.chaos_faults import KINDS, parse_plan, schedule


def test_the_schedule_is_seeded_spaced_and_overlaps():
    plan = schedule(7, 30)
    assert plan == schedule(7, 30) and plan != schedule(8, 30)
    steps = sorted({f.step for f in plan})
    assert steps[0] == 2 and steps[-1] <= 30
    assert all(1 <= b - a <= 3 for a, b in zip(steps, steps[1:]))
    per_step = Counter(f.step for f in plan)
    assert max(per_step.values()) == 2  # some steps get two faults, never the same kind twice
    assert all(len({f.kind for f in plan if f.step == s}) == per_step[s] for s in per_step)
    assert {f.kind for f in plan} <= set(KINDS)
    assert all(f.seconds > 0 for f in plan if f.kind == "search_delay")
    assert len(schedule(7, 30, max_faults=3)) == 3


def test_a_plan_by_hand_and_its_errors():
    plan = parse_plan("4:driver_sigterm, 2:scorer_replica+vllm_engine")
    assert [(f.step, f.kind) for f in plan] == [(2, "scorer_replica"), (2, "vllm_engine"), (4, "driver_sigterm")]
    with pytest.raises(ValueError, match="unknown fault kind 'gremlin'"):
        parse_plan("2:gremlin")
    with pytest.raises(ValueError, match="STEP >= 1"):
        parse_plan("x:node")
    with pytest.raises(ValueError, match="unknown fault kind"):
        schedule(0, 10, kinds=("node", "meteor"))


def _ledger(tmp_path, rows):
    led = Ledger(tmp_path)
    for r in rows:
        if r[0] == "start":
            led.start(r[1], r[2], "checkpoint")
        else:
            _, step, digest, prompts, versions = r
            led.trained(step, digest, prompts, versions, versions[:1], [], 0, True, {})
    return read(tmp_path)


EXPECTED = {1: Counter({"a": 1, "b": 1}), 2: Counter({"c": 1, "d": 1})}


def test_a_clean_lineage_passes_and_each_broken_one_is_named(tmp_path):
    good = [("start", 0, 1.0), ("trained", 1, 2.0, {"a": [1, 2], "b": [1, 2]}, [0, 0]),
            ("trained", 2, 3.0, {"c": [1, 2], "d": [1, 2]}, [1, 1])]
    assert cc.check_lineage(_ledger(tmp_path / "ok", good), EXPECTED, n=2, max_staleness=0) == []
    lost = good[:2] + [("trained", 2, 3.0, {"c": [2, 4]}, [1, 1])]
    [msg] = cc.check_lineage(_ledger(tmp_path / "lost", lost), EXPECTED, n=2, max_staleness=0)
    assert "step 2: prompt groups lost ['d'], extra or twice ['c']" == msg
    stale = good[:2] + [("trained", 2, 3.0, {"c": [1, 2], "d": [1, 2]}, [0, 1])]
    [msg] = cc.check_lineage(_ledger(tmp_path / "stale", stale), EXPECTED, n=2, max_staleness=0)
    assert "outside [1, 1]" in msg
    short = good[:2]
    assert cc.check_lineage(_ledger(tmp_path / "short", short), EXPECTED, 2, 0) == ["steps never trained: [2]"]
    episodes = good[:2] + [("trained", 2, 3.0, {"c": [1, 1], "d": [1, 2]}, [1, 1])]
    assert "episodes per group" in cc.check_lineage(_ledger(tmp_path / "n", episodes), EXPECTED, 2, 0)[0]


def test_an_over_sampled_lineage_trains_groups_of_its_window_once(tmp_path):
    """train.over_sampling: a step trains prompts_per_step groups of the blocks its lag allows, in any order,
    versions may fall between steps, and no drawn group is trained twice."""
    window = {1: Counter("abcd"), 2: Counter("abcdefgh")}  # block 0 = abcd, block 1 = efgh (max_staleness 1)
    drawn = Counter("abcdefgh")
    over = (window, drawn, 2)
    good = [("start", 0, 1.0), ("trained", 1, 2.0, {"c": [1, 2], "a": [1, 2]}, [0, 0]),
            ("trained", 2, 3.0, {"b": [1, 2], "e": [1, 2]}, [0, 1])]  # b: launched at version 0, buffered
    assert cc.check_lineage(_ledger(tmp_path / "ok", good), EXPECTED, 2, 1, over) == []
    twice = good[:2] + [("trained", 2, 3.0, {"a": [1, 2], "e": [1, 2]}, [0, 1])]
    assert cc.check_lineage(_ledger(tmp_path / "twice", twice), EXPECTED, 2, 1, over) == [
        "prompt groups trained more often than drawn: ['a']"]
    early = [good[0], ("trained", 1, 2.0, {"c": [1, 2], "e": [1, 2]}, [0, 0]), good[2]]
    assert cc.check_lineage(_ledger(tmp_path / "early", early), EXPECTED, 2, 1, over) == [
        "step 1: prompt groups not drawn for it ['e']", "prompt groups trained more often than drawn: ['e']"]
    short = good[:2] + [("trained", 2, 3.0, {"b": [1, 2]}, [0, 1])]
    assert cc.check_lineage(_ledger(tmp_path / "short", short), EXPECTED, 2, 1, over) == [
        "step 2: trained 1 prompt groups, not train.prompts_per_step=2"]


def test_a_resume_must_hold_the_weights_its_step_left(tmp_path):
    rows = [("start", 0, 1.0), ("trained", 1, 2.0, {"a": [1, 2]}, [0, 0]), ("trained", 2, 3.0, {"c": [1, 2]}, [1, 1]),
            ("start", 1, 2.0), ("trained", 2, 3.5, {"c": [1, 2]}, [1, 1]), ("start", 2, 3.5)]
    assert cc.check_starts(_ledger(tmp_path / "ok", rows)) == []  # step 2 retrained after the rollback: 3.5 now
    bad = rows[:3] + [("start", 2, 2.5)]
    [msg] = cc.check_starts(_ledger(tmp_path / "bad", bad))
    assert "start at step 2 holds weights of digest 2.5, not step 2's 3.0" in msg


def test_checkpoints_marked_complete_must_be_whole_and_the_log_must_have_each_step_once(tmp_path):
    ok = tmp_path / "checkpoints" / "step_00000002"
    ok.mkdir(parents=True)
    for name in (".metadata", "rng_rank0.pt", "rng_rank1.pt", "COMPLETE"):
        (ok / name).write_text("x")
    (ok / "trainer.json").write_text(json.dumps({"step": 2, "world_size": 2}))
    (tmp_path / "checkpoints" / "step_00000003").mkdir()  # killed mid-write: no marker, skipped
    assert cc.check_checkpoints(tmp_path) == []
    (ok / "rng_rank1.pt").unlink()
    assert cc.check_checkpoints(tmp_path) == ["step_00000002: 1 RNG files for 2 ranks"]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"kind": "train", "step": s}) + "\n" for s in (1, 2, 2)))
    assert cc.check_log(tmp_path, 3) == ["metrics.jsonl train rows: missing [3], twice [2]"]


def test_rest_allows_503_with_retry_after_only_and_no_hang():
    calls = [{"status": 200, "retry_after": None}, {"status": 503, "retry_after": "1"},
             {"status": 503, "retry_after": None}, {"status": 500, "retry_after": None},
             {"status": 0, "retry_after": None, "error": "ReadTimeout"}]
    assert cc.check_rest(calls) == ["REST: 1 response(s) with status 500",
                                    "REST: 1 response(s) with status 503 without Retry-After",
                                    "REST: 1 request(s) got no answer (ReadTimeout)"]


def test_overhead_is_the_two_faulted_steps_seconds_over_two_clean_medians():
    # steps of 10 s, but step 3 took 30 s and step 4 15 s (a fault in step 3 spilling into 4)
    times = {0: 0.0, 1: 10.0, 2: 20.0, 3: 50.0, 4: 65.0, 5: 75.0, 6: 85.0}
    rows = [{"event": "start", "step": 0, "time": 0.0, "digest": 1.0}]
    rows += [{"event": "trained", "step": s, "time": t, "digest": 1.0} for s, t in times.items() if s]
    out = cc.overhead(rows, [{"step": 3, "kind": "node"}, {"step": 3, "kind": "search_delay"}])
    assert out["median_clean_step_s"] == 10.0
    assert out["node"] == {"injected": 1, "steps": [3], "overhead_s": 25.0}
    rows.insert(3, {"event": "start", "step": 1, "time": 21.0, "digest": 1.0})  # a rollback: step 2 trained again
    rows.insert(4, {"event": "trained", "step": 2, "time": 30.0, "digest": 1.0})
    assert cc.overhead(rows, [{"step": 3, "kind": "node"}])["node"]["overhead_s"] == 15.0
