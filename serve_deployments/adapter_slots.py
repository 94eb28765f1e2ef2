"""Adapter slots of one replica: which versions are loaded, who is using them, and whom to evict.

Pure bookkeeping (no vLLM), so the policy reads in one place and tests without an engine:
- at most `capacity` adapters loaded;
- every request holds its version (refcount) from admission to its last token;
- to make room, evict the oldest loaded version nothing in flight uses, never one in use;
  if every slot is in use, refuse with SlotsFullError (the caller answers a clear error);
- a version's weights are fixed by its digest: the same name never serves other weights.
"""
from __future__ import annotations

from collections import Counter


class SlotsFullError(RuntimeError):
    """Every adapter slot holds a version with requests in flight."""


class AdapterSlots:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"adapter slots: capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.loaded: dict[int, str] = {}  # version -> PEFT dir the engine loaded it from
        self.inflight: Counter[int] = Counter()  # version -> requests holding it (0 = base model too)
        self._digests: dict[int, str] = {}  # every version ever loaded -> its sha256

    def is_loaded(self, version: int) -> bool:
        return version in self.loaded

    def check_digest(self, version: int, digest: str) -> None:
        seen = self._digests.get(version)
        if seen is not None and seen != digest:
            raise ValueError(f"policy-v{version} was loaded before with other weights ({seen[:12]} != {digest[:12]}); "
                             "a version name is never reused for new weights")

    def victim(self) -> int | None:
        """The version to evict before loading one more, or None when a slot is free."""
        if len(self.loaded) < self.capacity:
            return None
        idle = [v for v in self.loaded if self.inflight[v] == 0]
        if not idle:
            busy = {v: self.inflight[v] for v in sorted(self.loaded)}
            raise SlotsFullError(f"all {self.capacity} adapter slots hold versions with requests in flight {busy}; "
                                 "retry when one finishes")
        return min(idle)

    def add(self, version: int, path: str, digest: str) -> None:
        self.check_digest(version, digest)
        assert len(self.loaded) < self.capacity, "evict before adding"
        self.loaded[version] = path
        self._digests[version] = digest

    def remove(self, version: int) -> str | None:
        return self.loaded.pop(version, None)

    def acquire(self, version: int) -> None:
        self.inflight[version] += 1

    def release(self, version: int) -> None:
        self.inflight[version] -= 1
        if self.inflight[version] <= 0:
            del self.inflight[version]

    def digest(self, version: int) -> str | None:
        """The sha256 of the weights `version` was loaded with (kept after eviction), or None."""
        return self._digests.get(version)

    def ongoing(self) -> int:
        return sum(self.inflight.values())

    def versions(self) -> list[int]:
        return sorted(self.loaded)
