"""Intervals over training seeds (services/pipeline/stats.py): Student's t with seeds as the units."""

import math

import numpy as np
import pytest

from services.pipeline.stats import seed_t_interval, t975


def test_t_quantiles_match_the_table_and_approach_the_normal():
    assert t975(1) == 12.706 and t975(4) == 2.776 and t975(30) == 2.042
    assert abs(t975(31) - 2.040) < 0.001 and abs(t975(40) - 2.021) < 0.001 and abs(t975(120) - 1.980) < 0.001  # standard table values
    assert t975(10_000) == pytest.approx(1.96, abs=0.001)
    with pytest.raises(ValueError):
        t975(0)


def test_seed_interval_is_mean_plus_minus_t_standard_errors():
    d = [0.030, 0.021, 0.021, 0.043, -0.010]
    m, lo, hi = seed_t_interval(d)
    half = 2.776 * np.std(d, ddof=1) / math.sqrt(5)
    assert m == pytest.approx(np.mean(d)) and lo == pytest.approx(m - half) and hi == pytest.approx(m + half)
    assert lo < 0 < hi  # four seeds of five positive is not enough here
    m, lo, hi = seed_t_interval([0.1])
    assert m == 0.1 and math.isnan(lo) and math.isnan(hi)
    assert seed_t_interval([0.02, 0.02, 0.02])[1:] == pytest.approx((0.02, 0.02))  # no spread between seeds
