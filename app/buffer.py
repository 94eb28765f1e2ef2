"""RolloutBuffer: the bounded queue between rollout workers and the trainer, and the pacer of
generation.

Workers `acquire()` a slot before sampling a group and `put()` it when scored. Slot k belongs to batch
b = k // groups_per_step, and is granted only while b <= ready_version + lead, where lead is
`max_staleness` in async mode and 0 in sync mode (generate batch b only after version b is live).
So rollouts never run more than `max_staleness` versions ahead, and sync and async are one mechanism.

`ready_version` is the newest trainer version that new groups are generated under: the trainer's version
once the registry serves it. With `sync.overlap_publish` a version is handed to the registry in the
background, and grants wait for `mark_ready` (its replicas answer under it): slots granted earlier
would sample the previous version and be born one version staler, which on GPU runs with long
completions sent half the batches past `max_staleness` (dropped) while the trainer waited.

The trainer's rank 0 calls `get_batch(trainer_version, n_groups)`: groups older than
`trainer_version - max_staleness` are dropped and counted; the oldest acceptable groups go first (by version,
not in the order they finished: earliest deadline first). A group's version for this rule is `Group.version`:
with rollout.partial the version the group finished under (its newest token's), not the one it started with
(docs/ARCHITECTURE.md, "Partial rollouts").

Slots per worker: every caller passes its `worker_id` to `acquire` / `release` / `put`, and the buffer
tracks its granted-but-not-put slots; `reset_worker(worker_id)` (what a restarted worker calls first)
gives them back, so the restarted worker samples them again: none lost, none doubled. A call the dead
incarnation left behind cannot double a slot either: its pending `acquire` grants nothing after the
reset, and a late `put` for a slot already given back is dropped and counted (`orphan_puts`).

Prompts: the buffer is the run's one source of prompts (`common.data_cursor.PromptSource`): `acquire`
returns a `Grant` (`{"epoch", "row"}`) with the slot, so which prompt a slot samples is decided in one
place, and every way a group can be lost gives its prompt back to be handed out again: a stale group
dropped, a failed generation (`release(..., requeue=True)`), a dead worker's slots (`reset_worker`),
steps lost with a restored train worker group (`rewind`). Built from a checkpoint's record
(`consumed`), it skips what the checkpointed steps trained on. Groups dynamic sampling filtered out
reach the trainer's record with the next batch (`filtered`), so they are not sampled again either.
`request_stop` / `stop_requested`: the driver's Ctrl-C, read by the trainer between steps (it then
checkpoints and ends).
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import TypedDict

import ray

from common.data_cursor import PromptSource, prompt_key
from common.names import BUFFER_NAME  # noqa: F401  (the actor is created under it)
from common.types import Group


class Grant(TypedDict):
    """A slot granted by `acquire`: the prompt to sample and the data epoch it was handed out in."""

    epoch: int
    row: dict


@ray.remote(num_cpus=0)
class RolloutBuffer:
    def __init__(self, max_staleness: int, groups_per_step: int, rows: list[dict], *, lead: int | None = None,
                 seed: int = 0, epochs: int = 1, consumed: dict | None = None, trainer_version: int = 0,
                 take_after_served_s: float = 0.0):
        self.max_staleness = max_staleness
        # rollout.partial: a batch is taken once the version the trainer just published is served (at most this
        # long), since loading it is what moves the samples at the staleness limit (at_limit). Taken earlier, a
        # group of the oldest acceptable version that finishes between the take and the load misses this batch
        # and is below the floor at the next: the drops left on an H100 (BENCHMARKS.md section 19).
        self.take_after_served_s = take_after_served_s
        self.served_waits = self.served_wait_timeouts = 0
        self.served_wait_seconds = 0.0
        self.groups_per_step = groups_per_step
        self.lead = max_staleness if lead is None else lead
        self._q: deque[Group] = deque()
        self._cond = asyncio.Condition()
        self.trainer_version = trainer_version
        self.ready_version = trainer_version  # the newest trainer version being served
        self.granted = 0  # slots handed to workers (released slots are given back)
        self.dropped_groups = self.dropped_samples = self.dropped_continued_groups = 0
        # Why a group was dropped: it sat in the queue, acceptable, while a batch was taken without it (more
        # acceptable groups than a batch holds: `dropped_waited_groups`), or it was put after the last batch that
        # could take it (finished too late: the rest). id(group) -> batches taken while it was queued.
        self.dropped_waited_groups = 0
        self._passed: dict[int, int] = {}
        self.put_groups = self.taken_groups = 0
        self._closed = False
        # worker id -> its slots granted and neither released nor put: (epoch, prompt id)
        self._outstanding: dict[object, list[tuple[int, str]]] = {}
        self._incarnation: dict = {}  # worker id -> incarnation, bumped by reset_worker
        self.reset_slots = self.orphan_puts = self.expired_groups = 0
        self.source = PromptSource(rows, seed, epochs, consumed)
        self._filtered: list[str] = []  # prompt keys of filtered groups, for the next batch's record
        self.filtered_total = self.requeued_failed = self.requeued_stale = self.requeued_reset = 0
        self.rewound = 0
        self.trainer_starts = 0  # worker-group starts (rank 0 counts each first thing): restarts = starts - 1
        self._stop = False
        self._env_failures: dict[str, int] = {}  # prompt key -> episodes of it an environment failed
        self.env_requeued = self.env_dropped = 0

    def _may_grant(self) -> bool:
        return self.granted // self.groups_per_step <= self.ready_version + self.lead

    async def acquire(self, worker_id, timeout: float | None = None) -> Grant | None:
        """Wait for a slot and its prompt; None once the buffer is closed (training over), the data's
        epochs are all handed out, or `worker_id` was reset while waiting (the caller is a dead
        incarnation)."""
        async with self._cond:
            incarnation = self._incarnation.get(worker_id)
            await asyncio.wait_for(self._cond.wait_for(
                lambda: self._closed or self._incarnation.get(worker_id) != incarnation or self._may_grant()),
                timeout)
            if self._closed or self._incarnation.get(worker_id) != incarnation:
                return None
            handed = self.source.next()
            if handed is None:
                return None
            epoch, row = handed
            self.granted += 1
            self._outstanding.setdefault(worker_id, []).append((epoch, str(row["id"])))
            return Grant(epoch=epoch, row=row)

    def _pop_slot(self, worker_id, epoch: int, prompt_id: str) -> bool:
        """Remove the worker's outstanding slot for this prompt; False when it holds none (already
        given back by reset_worker)."""
        slots = self._outstanding.get(worker_id) or []
        if not slots:
            return False
        key = (int(epoch), str(prompt_id))
        slots.remove(key if key in slots else slots[0])
        return True

    async def release(self, worker_id, epoch: int, prompt_id: str, *, requeue: bool = False,
                      filtered: bool = False, expired: bool = False, env_failed: bool = False) -> None:
        """Give back a slot whose group failed or was dropped. `requeue` hands its prompt out again (a
        failed generation); `filtered` (dynamic sampling dropped the group: no signal) has it accounted
        for in the trainer's record with the next batch, never sampled again this epoch. `expired`: the
        group's version expired mid-generation (aborted: it would have been dropped as stale), counted
        in `expired_groups`. `env_failed`: a multi-turn environment failed an episode; the prompt comes
        again once, and a second failure has it accounted for like a filtered one (`env_dropped`)."""
        async with self._cond:
            if not self._pop_slot(worker_id, epoch, prompt_id):
                return  # already given back by reset_worker (which requeued its prompt)
            self.granted -= 1
            self.expired_groups += int(expired)
            if env_failed:
                key = prompt_key(epoch, prompt_id)
                self._env_failures[key] = self._env_failures.get(key, 0) + 1
                requeue, filtered = self._env_failures[key] == 1, self._env_failures[key] > 1
                self.env_requeued += int(requeue)
                self.env_dropped += int(filtered)
            if requeue:
                self.source.requeue(epoch, prompt_id)
                if expired:
                    self.requeued_stale += 1
                else:
                    self.requeued_failed += 1
            elif filtered:
                self._filtered.append(prompt_key(epoch, prompt_id))
                self.source.take(epoch, prompt_id)
                self.filtered_total += 1
            self._cond.notify_all()

    async def put(self, group: Group, worker_id) -> bool:
        """Queue a scored group; False (dropped, counted in `orphan_puts`) when its slot was already
        given back by `reset_worker`."""
        async with self._cond:
            if not self._pop_slot(worker_id, group.epoch, group.prompt_id):
                self.orphan_puts += 1
                return False
            self._q.append(group)
            self.put_groups += 1
            self._cond.notify_all()
            return True

    async def reset_worker(self, worker_id) -> int:
        """A (re)started worker's first call: its granted-but-not-put slots are given back (to be
        granted again) and any acquire its previous incarnation left waiting grants nothing. Returns
        the number of slots given back."""
        async with self._cond:
            slots = self._outstanding.pop(worker_id, [])
            for slot in slots:
                self.source.requeue(*slot)
            self.requeued_reset += len(slots)
            self._incarnation[worker_id] = self._incarnation.get(worker_id, 0) + 1
            self.granted -= len(slots)
            self.reset_slots += len(slots)
            self._cond.notify_all()
            return len(slots)

    def _drop_stale(self) -> bool:
        """Drop groups older than the staleness floor; their slots are given back so generation
        replaces them. Returns True so it can sit inside a wait_for predicate."""
        floor = self.trainer_version - self.max_staleness
        stale = [group for group in self._q if group.version < floor]
        if stale:
            self._q = deque(group for group in self._q if group.version >= floor)
            self.dropped_groups += len(stale)
            self.dropped_samples += sum(len(group.samples) for group in stale)
            # with rollout.partial: groups dropped after one of their samples had moved to a newer version
            self.dropped_continued_groups += sum(any(s.resumed for s in group.samples) for group in stale)
            self.dropped_waited_groups += sum(self._passed.pop(id(group), 0) > 0 for group in stale)
            self.granted -= len(stale)
            for group in stale:  # dropped, never trained on: the prompts come again
                self.source.requeue(group.epoch, group.prompt_id)
            self.requeued_stale += len(stale)
        return True

    async def get_batch(self, trainer_version: int, n_groups: int, timeout: float = 1800.0) -> dict | None:
        """Wait for `n_groups` acceptable groups and hand them out (oldest first); None once the buffer
        is closed: the driver ended the run (a failure elsewhere, a stall, Ctrl-C), and the trainer stops
        instead of failing into Ray Train's restarts."""
        t0 = time.perf_counter()
        async with self._cond:
            self._advance(trainer_version)
            served_wait = await self._wait_served(trainer_version)
            await asyncio.wait_for(
                self._cond.wait_for(lambda: self._closed or (self._drop_stale() and len(self._q) >= n_groups)),
                timeout)
            if len(self._q) < n_groups:
                return None
            # Earliest deadline first: a group must be trained before the trainer passes its version +
            # max_staleness, so the oldest versions go first, not the first finished. With long-tailed lengths
            # the two differ: short groups of later batches finish ahead of a long group of an earlier one, and
            # taken in finishing order they can push it past the floor (BENCHMARKS.md section 19).
            queued = sorted(self._q, key=lambda group: group.version)  # stable: a tie keeps finishing order
            groups, self._q = queued[:n_groups], deque(queued[n_groups:])
            for group in groups:
                self._passed.pop(id(group), None)
            for group in self._q:
                self._passed[id(group)] = self._passed.get(id(group), 0) + 1
            self.taken_groups += n_groups
            filtered, self._filtered = self._filtered, []
            for group in groups:
                self.source.take(group.epoch, group.prompt_id)
            self._cond.notify_all()
        # Staleness is reported by each group's oldest token (with rollout.partial older than the version the drop
        # rule judged, `group.version`, which staleness_accept_max reports); without it the two are one.
        oldest = [group.oldest_version for group in groups]
        return {
            "groups": groups,
            "wait_seconds": time.perf_counter() - t0,
            "staleness_mean": sum(trainer_version - v for v in oldest) / len(oldest),
            "staleness_max": max(trainer_version - v for v in oldest),
            "staleness_accept_max": max(trainer_version - group.version for group in groups),
            "served_wait_seconds": served_wait,
            "dropped_samples": self.dropped_samples,
            "filtered": filtered,
        }

    async def _wait_served(self, trainer_version: int) -> float:
        """With `take_after_served_s`: wait (lock released) until `trainer_version` is served, the buffer closes or
        the bound passes (a slow or failed publish then shows in the trainer's own flush). Returns seconds waited."""
        if self.take_after_served_s <= 0 or self.ready_version >= trainer_version:
            return 0.0
        t0 = time.perf_counter()
        self.served_waits += 1
        try:
            await asyncio.wait_for(self._cond.wait_for(
                lambda: self._closed or self.ready_version >= trainer_version), self.take_after_served_s)
        except asyncio.TimeoutError:
            self.served_wait_timeouts += 1
        waited = time.perf_counter() - t0
        self.served_wait_seconds += waited
        return waited

    def _advance(self, version: int) -> None:
        self.trainer_version = max(self.trainer_version, version)
        self._drop_stale()
        self._cond.notify_all()

    async def set_trainer_version(self, version: int, ready: bool = True) -> None:
        """Called by the trainer after each step: drops groups now too stale. With `ready` (the version is
        served already, or publishes nothing) it also frees generation slots for the next batches;
        otherwise `mark_ready` does when the registry serves it."""
        async with self._cond:
            self._advance(version)
            if ready:
                self._ready(version)

    async def mark_ready(self, version: int) -> None:
        """The registry serves `version` (a background publish finished): new groups sample it."""
        async with self._cond:
            self._ready(version)

    def _ready(self, version: int) -> None:
        self.ready_version = max(self.ready_version, version)  # mark_ready may overtake set_trainer_version
        self._cond.notify_all()

    async def stats(self) -> dict:
        return {"queued": len(self._q), "granted": self.granted, "put_groups": self.put_groups,
                "taken_groups": self.taken_groups, "dropped_groups": self.dropped_groups,
                "dropped_continued_groups": self.dropped_continued_groups,
                "dropped_waited_groups": self.dropped_waited_groups,
                "served_waits": self.served_waits, "served_wait_timeouts": self.served_wait_timeouts,
                "served_wait_seconds": round(self.served_wait_seconds, 3),
                "dropped_samples": self.dropped_samples, "trainer_version": self.trainer_version,
                "ready_version": self.ready_version, "trainer_starts": self.trainer_starts,
                "rollout_starts": self._rollout_starts(),
                "outstanding": {str(worker): len(slots) for worker, slots in self._outstanding.items() if slots},
                "reset_slots": self.reset_slots, "orphan_puts": self.orphan_puts,
                "expired_groups": self.expired_groups,
                "prompts": {**self.source.state(), "pending": self._pending(),
                            "requeued_failed": self.requeued_failed, "requeued_stale": self.requeued_stale,
                            "requeued_reset": self.requeued_reset, "filtered": self.filtered_total,
                            "rewound": self.rewound, "env_requeued": self.env_requeued,
                            "env_dropped": self.env_dropped}}

    def _pending(self) -> list[str]:
        """Prompts handed out and not yet taken by the trainer: waiting to be handed out again, being
        generated, or queued as groups ("epoch:id")."""
        keys = {prompt_key(*requeued) for requeued in self.source.requeued}
        keys |= {prompt_key(*slot) for slots in self._outstanding.values() for slot in slots}
        keys |= {prompt_key(group.epoch, group.prompt_id) for group in self._q}
        return sorted(keys)

    async def rewind(self, consumed: dict | None) -> int:
        """The trainer restored a checkpoint (a train worker group restarted): prompts it took since,
        which that checkpoint's record does not hold, are handed out again. Returns how many."""
        async with self._cond:
            requeued = self.source.rewind(consumed)
            # Each prompt taken since the checkpoint was a put group holding its slot: the slots go back with
            # the prompts. Kept, they count batches the restored trainer never trained as generated, pacing
            # (`_may_grant`) grants nothing until versions it cannot reach without them: a deadlock
            # (bench chaos, M = 20 seed 1: ten lost steps' slots against a lead of two).
            self.granted -= requeued
            self.rewound += requeued
            self._cond.notify_all()
            return requeued

    async def count_start(self) -> int:
        """A train worker group started (its rank 0 says so before loading anything, so a start that crashes
        counts too: app/watch.py's restart budget). Returns the count."""
        self.trainer_starts += 1
        return self.trainer_starts

    async def starts(self) -> dict:
        """Starts so far, without the rest of `stats` (the watch asks every step): the train worker group's
        (`train`) and each rollout worker's incarnations (`rollout`, by worker id)."""
        return {"train": self.trainer_starts, "rollout": self._rollout_starts()}

    def _rollout_starts(self) -> dict:
        return {str(worker): n for worker, n in self._incarnation.items()}

    async def request_stop(self) -> None:
        """Ctrl-C in the driver: the trainer checkpoints after its current step and ends."""
        self._stop = True

    async def stop_requested(self) -> bool:
        return self._stop

    async def close(self) -> None:
        async with self._cond:
            self._closed = True
            self._cond.notify_all()
