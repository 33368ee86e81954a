"""RolloutsAhead: batches in step order, never more than max_staleness versions ahead of the learner,
every rollout call's result scored once, as it lands. Stages are stand-ins here (the order and the
bound are the driver's logic); tests/scenarios/test_train_e2e.py runs the real services ahead."""

import threading
import time

import pytest

from services.config import load_config
from services.common.data import PromptStream
from services.common.messages import ChatMessage, Prompt
from services.pipeline.ahead import RolloutsAhead

STEPS = 6


class Driver:
    """Stand-in rollout and scorer drivers that answer at once, recording what the loop asked."""

    def __init__(self):
        self.generated, self.scored, self.min_versions = [], [], []
        self.cancelled = 0
        self.lock = threading.Lock()

    def rollout(self, batch, on_result=None):
        refs = [f"traj{batch.step}.{i}" for i in range(3)]
        self.generated.append((batch.step, batch.policy_version, len(batch.prompts)))
        assert batch.min_version == max(0, batch.step - self.staleness)  # the learner's bound, asked of replicas
        for i in (2, 0, 1):  # results land out of order
            if on_result is not None:
                on_result(i, refs[i])
        return refs

    def stream(self, min_version=-1):
        return Stream(self, min_version)


class Stream:
    """The scorer driver's stream, stand-in: every result handed over is scored once."""

    def __init__(self, driver, min_version):
        self.driver, self.min_version, self.added = driver, min_version, {}

    def add(self, i, ref):
        with self.driver.lock:
            self.driver.scored.append(ref)
            self.driver.min_versions.append(self.min_version)
        self.added[i] = f"score:{ref}"

    def results(self, n):
        assert set(self.added) == set(range(n))  # every call was scored as it landed
        return [self.added[i] for i in range(n)]

    def cancel(self):  # the rollout failed: nothing more comes
        self.driver.cancelled += 1


class Stages:
    def __init__(self, staleness=0):
        self.rollout = self.scorer = Driver()
        self.rollout.staleness = staleness
        self.synced = []

    def sync_weights(self, version):
        self.synced.append(version)
        return False


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_the_bound_holds_under_a_slow_learner(staleness):
    cfg = load_config("deploy/configs/tiny.yaml", [f"train.steps={STEPS}", f"train.max_staleness={staleness}",
                                                   "train.prompts_per_step=2"])
    prompts = PromptStream([Prompt(uid=str(i), messages=[ChatMessage("user", f"q{i}")], golds=[["a"]])
                            for i in range(5)], 2)
    stages = Stages(staleness)
    ahead = RolloutsAhead(cfg, stages, prompts, first_step=0)
    seen = []
    try:
        for step in range(STEPS):
            batch = ahead.next()
            assert batch.step == step
            assert batch.score_refs == [f"score:traj{step}.{i}" for i in range(3)]
            time.sleep(0.1)  # a learner slower than the rollout: the thread runs as far ahead as allowed
            with ahead._cond:
                generated = len(stages.rollout.generated)
            seen.append(generated)
            ahead.learner_at(step + 1)
    finally:
        ahead.close()
    lags = [step - version for step, version, _ in stages.rollout.generated]
    assert [s for s, *_ in stages.rollout.generated] == list(range(STEPS))
    assert max(lags) == staleness and min(lags) >= 0  # never beyond the bound, and the bound is used
    assert all(g <= step + 1 + staleness for step, g in enumerate(seen))  # while the learner trains step b
    assert sorted(stages.rollout.scored) == sorted(f"traj{s}.{i}" for s in range(STEPS) for i in range(3))  # once each
    assert stages.synced == (list(range(STEPS)) if staleness == 0 else [])


def test_an_error_in_generation_reaches_the_loop():
    cfg = load_config("deploy/configs/tiny.yaml", ["train.steps=3"])
    prompts = PromptStream([Prompt(uid="0", messages=[ChatMessage("user", "q")], golds=[["a"]])], 1)

    class Broken(Driver):
        def rollout(self, batch, on_result=None):
            raise RuntimeError("rollout replica gone")

    stages = Stages()
    stages.rollout = Broken()
    ahead = RolloutsAhead(cfg, stages, prompts, first_step=0)
    with pytest.raises(RuntimeError, match="rollout replica gone"):
        ahead.next()
    ahead.close()
    assert stages.scorer.cancelled == 1  # the step's scoring stream was told to stop waiting
