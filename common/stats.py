"""Statistics over a run's per-step metric rows."""
from __future__ import annotations

import math


def p50(xs) -> float | None:
    """The median-by-index of the values that are not None (the upper one of an even count); None when none."""
    xs = sorted(x for x in xs if x is not None)
    return xs[len(xs) // 2] if xs else None


def mean(xs) -> float | None:
    """The mean of the values that are not None; None when none (a metric no row carries)."""
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def proportion_z(first: list[dict], last: list[dict], samples_per_row: int) -> float:
    """Two-proportion z statistic of the per-sample success rate, `last` rows vs `first` rows (each row a
    step whose `reward_mean` averages `samples_per_row` 0/1 rewards): how far the reward rose beyond noise."""
    if not first or not last or samples_per_row < 1:
        raise ValueError(f"proportion_z needs rows on both sides and samples_per_row >= 1 (got {len(first)} and "
                         f"{len(last)} rows, samples_per_row {samples_per_row})")
    n1, n2 = len(first) * samples_per_row, len(last) * samples_per_row
    p1 = sum(r["reward_mean"] for r in first) * samples_per_row / n1
    p2 = sum(r["reward_mean"] for r in last) * samples_per_row / n2
    p = (p1 * n1 + p2 * n2) / (n1 + n2)
    se = math.sqrt(max(p * (1 - p), 1e-9) * (1 / n1 + 1 / n2))
    return (p2 - p1) / se
