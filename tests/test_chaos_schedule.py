"""The chaos soak's fault schedule (benchmarks/bench_chaos.py), without Ray: a seed gives the same faults and
waits every time, every kind comes once per shuffled round, waits stay in their bounds."""
from benchmarks.bench_chaos import KINDS, fault_schedule


def test_a_seed_gives_one_schedule_with_every_kind_per_round():
    a = fault_schedule(1, 3 * len(KINDS), (30.0, 90.0))
    assert a == fault_schedule(1, 3 * len(KINDS), (30.0, 90.0))
    assert a != fault_schedule(2, 3 * len(KINDS), (30.0, 90.0))
    for r in range(3):
        assert sorted(k for _, k in a[r * len(KINDS):(r + 1) * len(KINDS)]) == sorted(KINDS)
    assert all(30.0 <= w <= 90.0 for w, _ in a)
    assert fault_schedule(1, 4, (30.0, 90.0)) == a[:4]  # a longer soak starts with the shorter one's faults
