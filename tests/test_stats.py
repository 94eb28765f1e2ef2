"""common.stats.proportion_z: the reward-rise statistic the end-to-end tests and the benchmarks judge runs by."""
import math

import pytest

from common.stats import proportion_z


def test_a_clear_rise_scores_high_and_no_change_scores_zero():
    low, high = [{"reward_mean": 0.2}] * 4, [{"reward_mean": 0.8}] * 4
    # 64 samples a side: p 0.2 -> 0.8, pooled 0.5, se sqrt(0.25 * 2 / 64)
    assert proportion_z(low, high, 16) == pytest.approx(0.6 / math.sqrt(0.25 * 2 / 64))
    assert proportion_z(high, low, 16) < 0
    assert proportion_z(low, low, 16) == 0.0


def test_no_rows_is_refused_by_name():
    with pytest.raises(ValueError, match="rows on both sides"):
        proportion_z([], [{"reward_mean": 1.0}], 8)
