"""RolloutBuffer: the bounded queue between rollout workers and the trainer.

Workers `put` scored groups tagged with the policy version that sampled them. The trainer's rank 0
calls `get_batch(trainer_version, n_groups)`: groups older than `trainer_version - max_staleness` are
dropped (and counted), the oldest acceptable groups are handed out first. Workers call
`wait_for_room(version)` before sampling: it blocks while the buffer already holds enough samples for
the trainer's next steps, so generation never runs more than `max_staleness` versions ahead.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque

import ray

from common.types import Group

BUFFER_NAME = "rollout-buffer"


@ray.remote(num_cpus=0)
class RolloutBuffer:
    def __init__(self, max_staleness: int, groups_per_step: int, capacity_steps: int | None = None):
        self.max_staleness = max_staleness
        self.groups_per_step = groups_per_step
        # Enough for the steps the trainer can still accept at the current version.
        self.capacity = groups_per_step * (capacity_steps or max(1, max_staleness + 1))
        self._q: deque[Group] = deque()
        self._cond = asyncio.Condition()
        self.trainer_version = 0
        self.dropped_groups = 0
        self.dropped_samples = 0
        self.put_groups = 0
        self.taken_groups = 0
        self._closed = False

    async def put(self, group: Group) -> None:
        async with self._cond:
            self._q.append(group)
            self.put_groups += 1
            self._cond.notify_all()

    async def wait_for_room(self, timeout: float = 60.0) -> bool:
        """Block while the buffer is full; False when closed."""
        async with self._cond:
            try:
                await asyncio.wait_for(self._cond.wait_for(lambda: self._closed or len(self._q) < self.capacity),
                                       timeout)
            except asyncio.TimeoutError:
                pass
            return not self._closed

    def _drop_stale(self) -> None:
        floor = self.trainer_version - self.max_staleness
        keep = deque()
        for g in self._q:
            if g.version < floor:
                self.dropped_groups += 1
                self.dropped_samples += len(g.samples)
            else:
                keep.append(g)
        self._q = keep

    async def get_batch(self, trainer_version: int, n_groups: int, timeout: float = 600.0) -> dict:
        """Wait for `n_groups` acceptable groups and hand them out (oldest first)."""
        t0 = time.perf_counter()
        async with self._cond:
            self.trainer_version = max(self.trainer_version, trainer_version)
            self._drop_stale()
            self._cond.notify_all()
            ok = await asyncio.wait_for(
                self._cond.wait_for(lambda: self._closed or (self._drop_stale() or len(self._q) >= n_groups)),
                timeout)
            if self._closed and len(self._q) < n_groups:
                raise RuntimeError("rollout buffer closed before a full batch arrived")
            groups = [self._q.popleft() for _ in range(n_groups)]
            self.taken_groups += n_groups
            self._cond.notify_all()
        versions = [g.version for g in groups]
        return {
            "groups": groups,
            "wait_seconds": time.perf_counter() - t0,
            "staleness_mean": sum(trainer_version - v for v in versions) / len(versions),
            "staleness_max": max(trainer_version - v for v in versions),
            "dropped_samples": self.dropped_samples,
        }

    async def set_trainer_version(self, version: int) -> None:
        async with self._cond:
            self.trainer_version = max(self.trainer_version, version)
            self._drop_stale()
            self._cond.notify_all()

    async def stats(self) -> dict:
        return {"queued": len(self._q), "put_groups": self.put_groups, "taken_groups": self.taken_groups,
                "dropped_groups": self.dropped_groups, "dropped_samples": self.dropped_samples,
                "trainer_version": self.trainer_version}

    async def close(self) -> None:
        async with self._cond:
            self._closed = True
            self._cond.notify_all()
