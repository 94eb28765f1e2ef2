"""Weighted fair queuing of rollout groups between runs (serve_deployments/fair_queue.py): pure asyncio, no
engine needed, so no mock stands in for one."""
from __future__ import annotations

import asyncio

import pytest

from serve_deployments.fair_queue import FairQueue


async def _drain(q: FairQueue, submits: list[tuple[str, int, int]], hold_s: float = 0.0) -> list[str]:
    """Submit every group at once (in the given order); each holds its capacity for `hold_s`; returns the
    runs in admission order."""
    order: list[str] = []

    async def one(run, n, max_tokens):
        release = await q.acquire(run, n, max_tokens)
        order.append(run)
        await asyncio.sleep(hold_s)
        release()
        release()  # idempotent

    await asyncio.gather(*(one(*s) for s in submits))
    return order


def test_a_run_with_many_groups_queued_does_not_starve_another():
    q = FairQueue(capacity=8)
    q.set_weight("a")
    q.set_weight("b")
    # a queues 12 groups before b's 4 arrive: FIFO would serve all of a's first
    order = asyncio.run(_drain(q, [("a", 8, 10)] * 12 + [("b", 8, 10)] * 4))
    assert order[:8].count("b") == 4, order  # b's 4 groups interleave with a's first ones
    assert q.inflight == 0 and not q.queued()


def test_weights_and_costs_set_the_shares():
    q = FairQueue(capacity=4)
    q.set_weight("a", 2.0)
    q.set_weight("b", 1.0)
    order = asyncio.run(_drain(q, [("a", 4, 10)] * 20 + [("b", 4, 10)] * 20))
    first = order[:18]
    assert abs(first.count("a") - 2 * first.count("b")) <= 2, first  # 2:1 while both are queued
    q2 = FairQueue(capacity=4)
    q2.set_weight("long")
    q2.set_weight("short")
    # equal weights, 4x the tokens per group: the short run's groups go about 4 times as often
    order = asyncio.run(_drain(q2, [("long", 4, 400)] * 10 + [("short", 4, 100)] * 20))
    assert order[:15].count("short") >= 10, order[:15]


def test_an_idle_run_coming_back_is_not_owed_its_idle_time():
    async def go():
        q = FairQueue(capacity=1)
        q.set_weight("a")
        q.set_weight("b")
        await _drain(q, [("a", 1, 10)] * 30)  # a alone for a while
        return await _drain(q, [("a", 1, 10)] * 6 + [("b", 1, 10)] * 6)

    order = asyncio.run(go())
    assert order[:4].count("a") >= 1 and order[:6].count("b") <= 4, order  # b does not lock a out


def test_capacity_is_never_exceeded_and_oversized_groups_run_alone():
    async def go():
        q = FairQueue(capacity=6)
        q.set_weight("a")
        peak = 0

        async def one(n):
            nonlocal peak
            release = await q.acquire("a", n, 5)
            peak = max(peak, q.inflight)
            assert q.inflight <= 6 or q.inflight == n
            await asyncio.sleep(0.001)
            release()

        await asyncio.gather(*(one(n) for n in (4, 4, 2, 10, 3, 3, 6)))
        return peak, q.inflight

    peak, left = asyncio.run(go())
    assert peak == 10 and left == 0


def test_cancel_forget_and_bad_input():
    async def go():
        q = FairQueue(capacity=2)
        q.set_weight("a")
        q.set_weight("b")
        hold = await q.acquire("a", 2, 1)
        waiting = asyncio.ensure_future(q.acquire("a", 2, 1))
        gone = asyncio.ensure_future(q.acquire("b", 1, 1))
        await asyncio.sleep(0)
        waiting.cancel()
        q.forget("b")
        with pytest.raises(RuntimeError, match="left the fleet"):
            await gone
        with pytest.raises(asyncio.CancelledError):
            await waiting
        hold()
        assert q.inflight == 0 and not q.queued()
        with pytest.raises(KeyError, match="not attached"):
            await q.acquire("b", 1, 1)
        q.record("a", 30)
        q.set_weight("c")
        q.record("c", 10)
        return q.shares()

    assert asyncio.run(go()) == {"a": 0.75, "c": 0.25}
    with pytest.raises(ValueError, match="weight must be > 0"):
        FairQueue(1).set_weight("a", 0)
    with pytest.raises(ValueError, match="capacity"):
        FairQueue(0)
