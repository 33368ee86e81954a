"""A non-finite loss or gradient norm skips the optimizer step: the weights stay, the step is counted.

One LearnerWorker in this process (FSDP2 over gloo, world size 1), no Ray."""

import copy
import math

import numpy as np
import pytest

from services.common.codec import encode
from services.learner.worker import LearnerWorker

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def worker(setup, world):
    cfg, _ = setup
    w = LearnerWorker(0, 1, cfg.model_dump(mode="json"), str(world / "model"))
    w.join(*w.store_address())
    yield w
    w.shutdown()


def test_nan_loss_skips_the_update_and_keeps_the_weights(worker, setup):
    _, tb = setup
    bad = copy.deepcopy(tb)
    counted = np.flatnonzero(bad.loss_mask)
    bad.advantages[counted[len(counted) // 2]] = np.nan  # one counted token: NaN loss, NaN gradients
    before = worker.param_digest()
    m = worker.train_step(encode(bad))
    assert math.isnan(m["pg_loss"]) and not math.isfinite(m["grad_norm"])
    assert m["skipped_steps"] == 1.0
    assert worker.param_digest() == before, "a skipped step must not touch the weights"
    assert worker.optimizer_digest() == 0.0, "nor the optimizer state"
    ok = worker.train_step(encode(tb))
    assert math.isfinite(ok["grad_norm"]) and ok["skipped_steps"] == 1.0
    assert worker.param_digest() != before and worker.step == 2
