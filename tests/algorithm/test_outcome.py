"""The outcome-advantage rules (services/algorithm/outcome.py) on plain arrays, and the one switch that
selects them in the learner's advantages."""

import numpy as np
import pytest

from services.algorithm.outcome import OUTCOME_ADVANTAGES, dr_grpo, grpo
from services.config import load_config
from services.algorithm.advantages import compute_advantages
from services.common.messages import TrajectoryBatch
from tests.algorithm.test_advantages import _group


def test_grpo_divides_by_the_unbiased_std():
    a = grpo([1.0, 0.0, 0.0, 0.0], 1e-6)  # mean 0.25, unbiased std 0.5
    np.testing.assert_allclose(a, [1.5, -0.5, -0.5, -0.5], rtol=1e-5)
    assert a.dtype == np.float32


def test_dr_grpo_centres_without_the_std():
    np.testing.assert_allclose(dr_grpo([1.0, 0.0, 0.0, 0.0], 1e-6), [0.75, -0.25, -0.25, -0.25])
    # a group whose rewards barely differ keeps small advantages (grpo scales them to unit size)
    near = [0.50, 0.52, 0.50, 0.50]
    assert np.abs(dr_grpo(near, 1e-6)).max() < 0.02 < 1.0 < np.abs(grpo(near, 1e-6)).max()


@pytest.mark.parametrize("name", list(OUTCOME_ADVANTAGES))
def test_every_rule_gives_zero_for_a_constant_group_or_a_single_episode(name):
    fn = OUTCOME_ADVANTAGES[name].fn
    assert fn([1.0, 1.0, 1.0], 1e-6).tolist() == [0.0, 0.0, 0.0]
    assert fn([0.7], 1e-6).tolist() == [0.0]


def test_the_config_selects_the_rule_in_the_learners_advantages():
    batch = TrajectoryBatch(policy_version=0, groups=[_group(["Kroumia", "Lyon", "Lyon", "Lyon"])])  # R_out 1,0,0,0
    for name, want in (("grpo", [1.5, -0.5, -0.5, -0.5]), ("dr_grpo", [0.75, -0.25, -0.25, -0.25])):
        cfg = load_config(None, [f"algorithm.outcome_advantage={name}"]).algorithm
        adv = compute_advantages(batch, None, cfg)
        np.testing.assert_allclose([adv.a_out[(0, e)] for e in range(4)], want, rtol=1e-5)
        np.testing.assert_allclose(adv.token_advantages[(0, 0, 0)], want[0], rtol=1e-5)  # on every token
