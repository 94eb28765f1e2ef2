"""Weighted fair queuing of rollout groups between the runs sharing one fleet (docs/FLEET.md, "Fair share").

Each run has a weight and a virtual clock. A group costs `n x max_tokens` (the tokens it may generate);
its virtual finish time is `max(run's last finish, the queue's virtual now) + cost / weight`, and when
capacity frees up the group with the smallest finish time goes next. So a run with many groups queued
waits its turn instead of filling the engines, and an idle run that comes back is not owed the time it
was away (the `virtual now` floor). Capacity is counted in sequences in flight (the replicas'
`max_num_seqs` summed): a group is admitted whole, or not yet.

Pure asyncio bookkeeping, one per ingress; tests drive it without an engine.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(order=True)
class _Waiter:
    finish: float
    seq: int
    start: float = field(compare=False)
    run: str = field(compare=False)
    n: int = field(compare=False)
    future: asyncio.Future = field(compare=False)


class FairQueue:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"fair queue: capacity must be >= 1 sequence, got {capacity}")
        self.capacity = capacity
        self.inflight = 0
        self.weights: dict[str, float] = {}
        self._finish: dict[str, float] = {}  # run -> virtual finish time of its last admitted group
        self._now = 0.0  # virtual time: the start tag of the group admitted last
        self._heap: list[_Waiter] = []
        self._seq = itertools.count()
        self.tokens: Counter[str] = Counter()  # tokens generated per run (reported by `record`)

    def set_weight(self, run: str, weight: float = 1.0) -> None:
        if not weight > 0:
            raise ValueError(f"fair queue: run {run!r} weight must be > 0, got {weight}")
        self.weights[run] = float(weight)

    def forget(self, run: str) -> None:
        """A run that left: its queued groups fail, its clock and weight go."""
        for w in [w for w in self._heap if w.run == run]:
            if not w.future.done():
                w.future.set_exception(RuntimeError(f"run {run!r} left the fleet"))
        self._heap = [w for w in self._heap if w.run != run]
        heapq.heapify(self._heap)
        self.weights.pop(run, None)
        self._finish.pop(run, None)

    async def acquire(self, run: str, n: int, max_tokens: int) -> Callable[[], None]:
        """Wait for this group's turn; returns its release (idempotent). A group larger than the whole
        capacity is admitted alone when nothing else is in flight."""
        if run not in self.weights:
            raise KeyError(f"fair queue: run {run!r} is not attached")
        start = max(self._finish.get(run, 0.0), self._now)
        finish = start + n * max(1, max_tokens) / self.weights[run]
        self._finish[run] = finish
        waiter = _Waiter(finish, next(self._seq), start, run, n, asyncio.get_running_loop().create_future())
        heapq.heappush(self._heap, waiter)
        self._admit()
        try:
            await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():  # admitted as we were cancelled
                self._release(n)
            else:
                self._drop(waiter)
            raise
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._release(n)

        return release

    def record(self, run: str, tokens: int) -> None:
        self.tokens[run] += int(tokens)

    def shares(self) -> dict[str, float]:
        """Each run's fraction of the tokens generated so far."""
        total = sum(self.tokens.values())
        return {run: count / total for run, count in self.tokens.items()} if total else {}

    def queued(self) -> Counter[str]:
        return Counter(w.run for w in self._heap)

    def _admit(self) -> None:
        while self._heap:
            head = self._heap[0]
            if head.future.done():  # cancelled while queued
                heapq.heappop(self._heap)
                continue
            if self.inflight + head.n > self.capacity and self.inflight > 0:
                return
            heapq.heappop(self._heap)
            self.inflight += head.n
            self._now = max(self._now, head.start)
            head.future.set_result(None)

    def _release(self, n: int) -> None:
        self.inflight -= n
        self._admit()

    def _drop(self, waiter: _Waiter) -> None:
        if waiter in self._heap:
            self._heap.remove(waiter)
            heapq.heapify(self._heap)
