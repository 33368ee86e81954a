"""The learner's ledger: whole lines, the lineage through rollbacks, and the rows the driver missed."""

from services.learner.ledger import Ledger, lineage, read, unlogged


def _trained(led: Ledger, step: int, digest: float = 1.0) -> None:
    led.trained(step, digest, {f"u{step}": [1, 2]}, [step - 1, step - 1], [step - 1], [], 0, True,
                {"reward_mean": 0.5, "checkpoint": "path", "groups": [{"not": "a metric"}]})


def test_a_torn_last_line_is_skipped_and_metrics_keep_plain_values_only(tmp_path):
    led = Ledger(tmp_path)
    led.start(0, 3.0, "fresh")
    _trained(led, 1)
    with open(led.path, "a") as f:
        f.write('{"event": "trained", "step": 2, "dig')  # a process killed mid-write
    rows = read(tmp_path)
    assert [r["event"] for r in rows] == ["start", "trained"]
    assert rows[1]["metrics"] == {"reward_mean": 0.5, "checkpoint": "path"}
    assert rows[1]["turn_versions"] == [0, 0] and rows[1]["prompts"] == {"u1": [1, 2]}


def test_a_start_rolls_back_the_steps_after_it_and_a_retrained_step_counts_once(tmp_path):
    led = Ledger(tmp_path)
    led.start(0, 3.0, "fresh")
    for s in (1, 2, 3):
        _trained(led, s, digest=float(s))
    led.start(1, 1.0, "rebuilt")  # a worker died in step 4; the checkpoint of step 1 was the latest
    for s in (2, 3, 4):
        _trained(led, s, digest=10.0 + s)
    kept, rolled_back, twice = lineage(read(tmp_path))
    assert sorted(kept) == [1, 2, 3, 4] and kept[2]["digest"] == 12.0
    assert [r["step"] for r in rolled_back] == [2, 3] and twice == []


def test_a_step_trained_again_without_a_rollback_is_reported(tmp_path):
    led = Ledger(tmp_path)
    led.start(0, 3.0, "fresh")
    _trained(led, 1)
    _trained(led, 1)
    _, _, twice = lineage(read(tmp_path))
    assert [r["step"] for r in twice] == [1]


def test_unlogged_gives_the_learner_rows_the_driver_log_lacks(tmp_path):
    led = Ledger(tmp_path)
    led.start(0, 3.0, "fresh")
    for s in (1, 2, 3):
        _trained(led, s)
    rows = unlogged(tmp_path, logged={1, 2}, upto=3)
    assert [r["step"] for r in rows] == [3] and rows[0]["reward_mean"] == 0.5
    assert unlogged(tmp_path, logged={1, 2, 3}, upto=3) == []
    assert unlogged(tmp_path / "none", logged=set(), upto=3) == []
