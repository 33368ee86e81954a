"""Fixtures of the learner tests: one real training batch from world data."""

import numpy as np
import pandas as pd
import pytest
from transformers import AutoTokenizer

from services.common.config import load_config
from services.common.messages import TrajectoryBatch
from services.learner.advantages import compute_advantages
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


