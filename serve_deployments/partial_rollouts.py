"""Partial rollouts on the replica (`rollout.partial`; docs/ARCHITECTURE.md, "Partial rollouts"): a rollout
request that moves to a newer version of its run while it generates, instead of finishing under (or being
dropped with) the version it started with.

A partial request runs as segments, one engine request each. The table below knows every running segment by
run; two events move them:
- a newer version of the run is loaded on this replica (`newer_loaded`, from the adapter-load path): with
  policy `all`, every segment of the run under an older version moves; with policy `at_limit`, the segments
  whose version is now `limit` (the run's sync.max_staleness, sent with the request) or more behind it. Those
  are the samples the trainer's next batch could no longer take once they finish: the trainer takes a batch
  as soon as it publishes, so a group still running under the oldest acceptable version misses that batch
  and is below the drop floor at the next (a 2-core run dropped 1-3 such groups in 30 steps when at_limit
  moved on `expire` alone, one version later);
- the run's registry expires versions (`expired`, from `expire`): segments under them move, whatever the
  policy (a request sent without a limit moves only then: exactly the requests that would otherwise get
  VersionExpiredError);
- the version is unloaded here (`leaving`: an operator's unload, or the rollback of a load a lost replica
  failed): its segments move to the run's newest version left, older if need be, and the unload does not
  wait for the rest of their completions.
Moving = the generate coroutine aborts its engine request, keeps the tokens and logprobs vLLM hands back
with the abort (finish_reason "abort"), and submits prompt + those token ids under the newest version of the
run this replica serves (replica_rollout.py). `forget_run` cancels instead (`cancel_run`): the run left.
"""
from __future__ import annotations

import asyncio
import typing

from common.config.choices import PartialPolicy

PARTIAL_POLICIES: tuple[str, ...] = typing.get_args(PartialPolicy)


class Segment:
    """One partial request's running engine request: its run, version, policy and staleness limit (at_limit; None:
    moved on expire alone), which segment of its request it is (0: the first; more: a continuation), and the
    signal to move."""

    __slots__ = ("run", "version", "policy", "limit", "index", "move", "cancelled")

    def __init__(self, run: str, version: int, policy: str, index: int = 0, limit: int | None = None):
        self.run, self.version, self.policy, self.index = run, int(version), policy, int(index)
        self.limit = None if limit is None else int(limit)
        self.move = asyncio.Event()
        self.cancelled = False  # the run left: abort, do not continue


def moves_on_load(policy: str, limit: int | None, version: int, newest: int) -> bool:
    """Whether a segment under `version` moves once `newest` is loaded: when older, always under policy all, under
    at_limit when `limit` or more versions behind."""
    return version < newest and (policy == "all" or (limit is not None and newest - version >= limit))


class PartialTable:
    """The running segments of partial requests, by run."""

    def __init__(self):
        self._by_run: dict[str, set[Segment]] = {}
        self.moved = 0  # segments signalled to move (replica stats)

    def add(self, seg: Segment) -> None:
        self._by_run.setdefault(seg.run, set()).add(seg)

    def discard(self, seg: Segment) -> None:
        segs = self._by_run.get(seg.run)
        if segs is not None:
            segs.discard(seg)
            if not segs:
                self._by_run.pop(seg.run, None)

    def _signal(self, segs) -> int:
        n = 0
        for seg in segs:
            if not seg.move.is_set():
                seg.move.set()
                n += 1
        self.moved += n
        return n

    def newer_loaded(self, version: int, run: str = "") -> int:
        """Run `run`'s `version` was loaded here: policy-`all` segments under older versions move, and policy-
        `at_limit` ones at their limit or past it."""
        segs = self._by_run.get(run, ())
        return self._signal([s for s in segs if moves_on_load(s.policy, s.limit, s.version, version)])

    def expired(self, versions, run: str = "") -> int:
        """The registry expired these versions of `run`: their segments move (every policy)."""
        gone = {int(v) for v in versions}
        return self._signal([s for s in self._by_run.get(run, ()) if s.version in gone])

    def leaving(self, version: int, run: str = "") -> int:
        """Run `run`'s `version` is being unloaded here: its segments move (every policy), to an older version
        if it was the newest."""
        return self._signal([s for s in self._by_run.get(run, ()) if s.version == int(version)])

    def cancel_run(self, run: str) -> int:
        """The run leaves the replica: its partial requests end (VersionExpiredError), none continues."""
        segs = list(self._by_run.get(run, ()))
        for seg in segs:
            seg.cancelled = True
            seg.move.set()
        return len(segs)

    def running(self, run: str | None = None) -> int:
        return sum(len(s) for r, s in self._by_run.items() if run is None or r == run)

    def stats(self) -> dict:
        """The replica's `stats()["partial"]`: segments running, of which continuations, and moves so far."""
        segs = [seg for segs in self._by_run.values() for seg in segs]
        return {"running": len(segs), "continuations": sum(seg.index > 0 for seg in segs), "moved": self.moved}
