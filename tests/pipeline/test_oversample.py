"""GroupPool (train.over_sampling): a step trains the first groups to complete, the rest stay in flight
for later steps, groups older than the lag bound are dropped and counted, no prompt position is drawn
twice. The stages are a stand-in ``generate`` whose groups take the time a test gives them (the pool's
logic is the driver's); tests/scenarios/test_train_e2e.py runs it on the real services."""

import threading
import time

import pytest

from services.common.data import PromptStream
from services.common.messages import ChatMessage, Prompt
from services.config import ConfigError, load_config
from services.pipeline.ahead import RolloutsAhead
from services.pipeline.oversample import GroupPool


def _prompts(n=50):
    return PromptStream([Prompt(uid=f"p{i}", messages=[ChatMessage("user", f"q{i}")], golds=[["a"]]) for i in range(n)], 2)


class Stages:
    """``generate`` stand-in: a group's rollout takes ``delay(uid)`` seconds; records what was asked."""

    def __init__(self, delay=lambda uid: 0.01, fail=()):
        self.delay, self.fail = delay, set(fail)
        self.asked = []  # (uid, policy_version, min_version, step)
        self.lock = threading.Lock()

    def generate(self, cfg, pipe, batch):
        (prompt,) = batch.prompts
        with self.lock:
            self.asked.append((prompt.uid, batch.policy_version, batch.min_version, batch.step))
        time.sleep(self.delay(prompt.uid))
        if prompt.uid in self.fail:
            raise RuntimeError(f"rollout call for {prompt.uid} failed after its retries")
        return [f"traj:{prompt.uid}"], [f"score:{prompt.uid}"], 0.0, 0.0


def _cfg(over=2.0, staleness=1, per_step=2):
    return load_config("deploy/configs/tiny.yaml", [f"train.over_sampling={over}", f"train.max_staleness={staleness}",
                                                    f"train.prompts_per_step={per_step}"])


def test_a_step_trains_the_first_groups_to_complete_and_keeps_the_rest():
    prompts = _prompts()
    slow = {prompts.prompt_at(0).uid, prompts.prompt_at(1).uid}  # the first two drawn are the slowest
    stages = Stages(delay=lambda uid: 0.6 if uid in slow else 0.02)
    pool = GroupPool(_cfg(over=2.0), None, prompts, stages.generate)
    try:
        traj, scores, m = pool.take(0, version=0)
        assert len(traj) == 2 and not set(traj) & {f"traj:{u}" for u in slow}  # nobody waited for the slow ones
        assert scores == [t.replace("traj:", "score:") for t in traj]
        assert m["oversample/groups_launched"] == 4 and m["oversample/groups_in_flight"] + \
            m["oversample/groups_buffered"] == 2
        time.sleep(0.8)  # the slow groups finish meanwhile: the next step takes them first, launching two more
        traj1, _, m1 = pool.take(1, version=1)
        assert set(traj1) == {f"traj:{u}" for u in slow}
        assert m1["oversample/groups_launched"] == 2 and m1["oversample/taken_version_min"] == 0
        deadline = time.monotonic() + 5
        while len(stages.asked) < 6 and time.monotonic() < deadline:  # step 1's two launches start running
            time.sleep(0.01)
    finally:
        pool.close()
    positions = [u for u, *_ in stages.asked]
    assert len(positions) == len(set(positions)) == 6
    assert {u for u, *_ in stages.asked[4:]} == {prompts.prompt_at(4 * 1 + i).uid for i in range(2)}  # step 1's block
    assert all(v == mv for _, v, mv, _ in stages.asked)  # a replica must hold at least the launch version


def test_groups_older_than_the_bound_are_dropped_and_counted():
    prompts = _prompts()
    stuck = prompts.prompt_at(0).uid
    stages = Stages(delay=lambda uid: 1.5 if uid == stuck else 0.02)
    pool = GroupPool(_cfg(over=1.5, staleness=1, per_step=2), None, prompts, stages.generate)
    try:
        pool.take(0, version=0)
        pool.take(1, version=1)  # the stuck group (version 0) may still train step 1
        traj, _, m = pool.take(2, version=2)  # ... but not step 2: dropped while it runs
        assert f"traj:{stuck}" not in traj and m["oversample/dropped_groups"] == 1
        assert m["oversample/dropped_groups_total"] == 1
    finally:
        pool.close()


def test_a_group_that_keeps_failing_fails_the_step():
    prompts = _prompts()
    stages = Stages(fail=[prompts.prompt_at(1).uid])
    pool = GroupPool(_cfg(over=1.0001, staleness=1, per_step=2), None, prompts, stages.generate)
    try:
        with pytest.raises(RuntimeError, match="failed after its retries"):
            for step in range(3):
                pool.take(step, version=step)
    finally:
        pool.close()


def test_over_sampling_needs_a_lag_bound_and_counts_its_groups():
    with pytest.raises(ConfigError, match=r"train\.over_sampling: 1\.5 keeps groups running"):
        load_config("deploy/configs/tiny.yaml", ["train.over_sampling=1.5"])
    assert _cfg(over=1.5, per_step=8).train.groups_in_flight == 12
    assert _cfg(over=1.01, per_step=8).train.groups_in_flight == 9  # at least one group more than a step takes
    assert load_config("deploy/configs/tiny.yaml", ["train.prompts_per_step=8"]).train.groups_in_flight == 8


def test_the_loop_runs_on_the_pool_with_its_metrics(monkeypatch):
    cfg = _cfg(over=1.5, staleness=1, per_step=2)
    cfg.train.steps = 4
    stages = Stages()
    monkeypatch.setattr("services.pipeline.ahead.generate", stages.generate)  # the pool's one rollout path
    ahead = RolloutsAhead(cfg, stages, _prompts(), first_step=0)
    try:
        for step in range(4):
            batch = ahead.next()
            assert batch.step == step and len(batch.traj_refs) == 2
            assert batch.pool["oversample/taken_version_min"] >= step - 1
            assert batch.started_at_version == batch.pool["oversample/taken_version_min"]
            ahead.learner_at(step + 1)
    finally:
        ahead.close()
    uids = [u for u, *_ in stages.asked]
    assert len(uids) == len(set(uids))


def test_a_stop_drops_the_buffer_and_the_report_counts_it(tmp_path):
    from services.pipeline.report import oversample_lines
    from services.pipeline.runlog import RunLog

    prompts = _prompts()
    stages = Stages(delay=lambda uid: 0.3 if uid == prompts.prompt_at(3).uid else 0.01)
    pool = GroupPool(_cfg(over=2.0), None, prompts, stages.generate)
    traj, _, m = pool.take(0, version=0)
    time.sleep(0.1)
    dropped = pool.close()  # one group still running, one done and buffered (or both running)
    assert dropped["oversample/dropped_at_stop_running"] + dropped["oversample/dropped_at_stop_buffered"] == 2
    log = RunLog(tmp_path, tensorboard=False)
    log.write("train", 1, {**m, "version_lag_token_max": 1.0}, console=False)
    log.write("stop", 1, dropped, console=False)
    [line, _] = oversample_lines(tmp_path / "metrics.jsonl")
    assert line == ("Over-sampling: 0 groups dropped as older than train.max_staleness over 1 steps, 2 in flight or "
                    "buffered dropped at 1 stop(s); tokens trained at most 1 version(s) old.")
    assert oversample_lines(tmp_path / "nothing.jsonl") == []


def test_closing_the_pool_while_a_step_waits_ends_that_wait():
    prompts = _prompts()
    stages = Stages(delay=lambda uid: 0.5)
    pool = GroupPool(_cfg(over=1.5), None, prompts, stages.generate)
    errors = []

    def take():
        try:
            pool.take(0, version=0)
        except RuntimeError as e:
            errors.append(str(e))

    t = threading.Thread(target=take)
    t.start()
    time.sleep(0.1)
    pool.close()
    t.join(timeout=5)
    assert not t.is_alive() and errors == ["the group pool was closed while a step waited for its groups"]
