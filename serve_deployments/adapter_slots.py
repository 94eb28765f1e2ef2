"""Adapter slots of one replica: which adapters are loaded, who is using them, and whom to evict.

An adapter is a run's version, `AdapterKey(run, version)` (docs/FLEET.md); a standalone service is the fleet
run "", so every call takes `version, run=""` and means for run "" what it always meant.

Pure bookkeeping (no vLLM), so the policy reads in one place and tests without an engine:
- at most `capacity` adapters loaded in all, and at most a run's quota of that run's (`set_quota`; the run ""
  has the whole capacity unless set, so a standalone replica behaves as before quotas existed);
- every request holds its adapter (refcount) from admission to its last token;
- to make room for one more of a run, evict that run's oldest version nothing in flight uses, never one in
  use and never another run's; the one exception is a run under its quota while other runs filled the
  replica (their quota shrank): then it takes an idle slot of a run over its own quota. If there is nothing
  to evict, refuse with SlotsFullError (the caller answers a clear error);
- an adapter's weights are fixed by its digest: the same (run, version) never serves other weights, until
  `forget(run)` (the run left the fleet; a later run of that name is another run).
"""
from __future__ import annotations

from collections import Counter
from typing import NamedTuple

from common.types import adapter_name


class SlotsFullError(RuntimeError):
    """No slot the run may take: every candidate holds a version with requests in flight."""


class AdapterKey(NamedTuple):
    """One run's version: equal to the plain tuple `(run, version)`."""

    run: str
    version: int

    @property
    def name(self) -> str:
        """The serving name: `policy-vN` (run "") or `RUN/policy-vN`; version 0 (no adapter, the base model):
        `base`, or `RUN/base` for a fleet run's requests on it (in stats)."""
        if self.version > 0:
            return adapter_name(self.version, self.run)
        return f"{self.run}/base" if self.run else "base"


class AdapterSlots:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"adapter slots: capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.loaded: dict[AdapterKey, str] = {}  # key -> PEFT dir the engine loaded it from
        self.inflight: Counter[AdapterKey] = Counter()  # key -> requests holding it (version 0 = base model too)
        self._digests: dict[AdapterKey, str] = {}  # every key ever loaded (until its run is forgotten) -> sha256
        self._quotas: dict[str, int] = {}  # run -> slots it may fill; the run "" defaults to the capacity

    # ------------------------------------------------------------------ quotas

    def set_quota(self, run: str, slots: int) -> None:
        """How many of the slots `run` may fill (0..capacity). A quota below what the run holds now evicts
        nothing at once: its next load evicts its own, and other runs may take its idle excess."""
        if not 0 <= int(slots) <= self.capacity:
            raise ValueError(f"run {run!r}: quota {slots} must be within 0..{self.capacity} (the replica's slots)")
        self._quotas[run] = int(slots)

    def quota(self, run: str = "") -> int:
        return self._quotas.get(run, self.capacity if run == "" else 0)

    def quotas(self) -> dict[str, int]:
        """The quotas set (the run "" only when set; otherwise it has the whole capacity)."""
        return dict(self._quotas)

    def forget(self, run: str) -> None:
        """The run left: drop its quota and digests. Its adapters must be evicted first."""
        if any(k.run == run for k in self.loaded):
            raise ValueError(f"run {run!r} still has adapters loaded {self.versions(run)}; evict them first")
        self._quotas.pop(run, None)
        self._digests = {k: d for k, d in self._digests.items() if k.run != run}
        for k in [k for k in self.inflight if k.run == run]:
            del self.inflight[k]

    # ------------------------------------------------------------------ loading

    def is_loaded(self, version: int, run: str = "") -> bool:
        return (run, version) in self.loaded

    def check_digest(self, version: int, digest: str, run: str = "") -> None:
        seen = self._digests.get(AdapterKey(run, version))
        if seen is not None and seen != digest:
            raise ValueError(f"{adapter_name(version, run)} was loaded before with other weights ({seen[:12]} != "
                             f"{digest[:12]}); a version name is never reused for new weights")

    def victim(self, run: str = "") -> AdapterKey | None:
        """The adapter to evict before loading one more of `run`, or None when it may take a free slot
        (module docstring)."""
        mine = [k for k in self.loaded if k.run == run]
        quota = self.quota(run)
        if len(mine) < quota and len(self.loaded) < self.capacity:
            return None
        if len(mine) < quota:  # under its quota, but runs over theirs filled the replica
            over = {r: n - self.quota(r) for r, n in Counter(k.run for k in self.loaded).items()
                    if r != run and n > self.quota(r)}
            idle = [k for k in self.loaded if k.run in over and self.inflight[k] == 0]
            if not idle:
                raise SlotsFullError(f"run {run!r} is under its quota of {quota} adapter slots, but all "
                                     f"{self.capacity} are full and none over another run's quota is idle "
                                     f"{self._busy()}; retry when one finishes")
            # The run most over its quota gives back its oldest idle version.
            return min(idle, key=lambda k: (-over[k.run], k.run, k.version))
        idle = [k for k in mine if self.inflight[k] == 0]
        if not idle:
            if not mine:
                raise SlotsFullError(f"run {run!r} has no adapter slots on this replica (quota {quota})")
            raise SlotsFullError(f"all {len(mine)} adapter slots of {self._who(run)} hold versions with requests "
                                 f"in flight {self._busy(run)}; retry when one finishes")
        return min(idle, key=lambda k: k.version)

    def _who(self, run: str) -> str:
        return f"run {run}" if run else "this replica"

    def _busy(self, run: str | None = None) -> dict[str, int]:
        return {k.name: self.inflight[k] for k in sorted(self.loaded) if run is None or k.run == run}

    def add(self, version: int, path: str, digest: str, run: str = "") -> None:
        self.check_digest(version, digest, run)
        assert len(self.loaded) < self.capacity, "evict before adding"
        assert len(self.versions(run)) < self.quota(run), f"run {run!r}: evict before adding (quota)"
        key = AdapterKey(run, version)
        self.loaded[key] = path
        self._digests[key] = digest

    def remove(self, version: int, run: str = "") -> str | None:
        return self.loaded.pop(AdapterKey(run, version), None)

    # ------------------------------------------------------------------ requests

    def acquire(self, version: int, run: str = "") -> None:
        self.inflight[AdapterKey(run, version)] += 1

    def release(self, version: int, run: str = "") -> None:
        key = AdapterKey(run, version)
        self.inflight[key] -= 1
        if self.inflight[key] <= 0:
            del self.inflight[key]

    def inflight_of(self, version: int, run: str = "") -> int:
        return self.inflight.get(AdapterKey(run, version), 0)

    def digest(self, version: int, run: str = "") -> str | None:
        """The sha256 of the weights (run, version) was loaded with (kept after eviction), or None."""
        return self._digests.get(AdapterKey(run, version))

    def ongoing(self, run: str | None = None) -> int:
        """Requests in flight: all of them, or run `run`'s."""
        return sum(n for k, n in self.inflight.items() if run is None or k.run == run)

    def versions(self, run: str = "") -> list[int]:
        """Run `run`'s loaded versions, oldest first."""
        return sorted(k.version for k in self.loaded if k.run == run)

    def keys(self) -> list[AdapterKey]:
        """Every loaded adapter, by run then version."""
        return sorted(self.loaded)
