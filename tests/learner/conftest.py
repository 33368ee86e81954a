"""Fixtures of the learner tests: one real training batch from world data."""

import numpy as np
import pandas as pd
import pytest
from transformers import AutoTokenizer

from services.config import load_config
from services.common.messages import TrajectoryBatch
from services.algorithm.advantages import compute_advantages
from services.learner.samples import training_batch
from services.world.oracle_records import oracle_group


@pytest.fixture(scope="session")
def setup(world):
    cfg = load_config("deploy/configs/tiny.yaml", ["learner.lr=1e-3", "learner.num_cpus_per_worker=0.25",
                                                   "learner.micro_token_budget=2048"])
    tok = AutoTokenizer.from_pretrained(world / "model")
    rows = [r for r in pd.read_parquet(world / "train.parquet").to_dict("records") if r["extra_info"]["k"] == 1][:2]
    batch = TrajectoryBatch(groups=[oracle_group(cfg, world, r, n=4, tokenizer=tok, seed=i) for i, r in enumerate(rows)],
                            policy_version=0)
    adv = compute_advantages(batch, None, cfg.algorithm)
    rng = np.random.default_rng(0)  # oracle groups are mostly all-correct: give every token a real advantage
    for k, v in adv.token_advantages.items():
        adv.token_advantages[k] = rng.normal(size=v.shape).astype(np.float32)
    return cfg, training_batch(batch, adv)


REFERENCE_STEPS = 4  # the longest uninterrupted run a test compares with (test_checkpoint's kill and resume)


@pytest.fixture(scope="session")
def uninterrupted(ray_cluster, setup, world):
    """``uninterrupted(world_size)``: the uninterrupted run of ``setup``'s config and batch at that world size,
    one list entry per step: (train_step's metrics, full_state_dict(), optimizer_digest()) after steps 1 to
    REFERENCE_STEPS. The reference the W=1/W=2 and checkpoint-resume tests compare with: one group per world size
    for the session (the snapshots between steps only read state), not one in every test."""
    from services.learner.group import LearnerGroup

    cfg, tb = setup
    runs: dict[int, list] = {}

    def run(world_size: int) -> list:
        if world_size not in runs:
            group = LearnerGroup(cfg, str(world / "model"), world_size=world_size)
            try:
                runs[world_size] = [(group.train_step(tb), group.full_state_dict(), group.optimizer_digest())
                                    for _ in range(REFERENCE_STEPS)]
            finally:
                group.shutdown()
        return runs[world_size]

    return run
