"""Which versions the ingress offers, and what each one is.

The AdapterRegistry owns which versions are live: it marks one live only after the ingress's
`load_adapter` returned, i.e. after every replica acknowledged. The ingress only withholds versions an
operator unloaded (`unloaded`), and knows which version the base weights are (`merged_version`: 0, or N
after merge mode swapped in policy-vN's merged weights). See docs/ARCHITECTURE.md, "Versions and staleness".
"""
from __future__ import annotations

from collections.abc import Callable

from ray.actor import ActorHandle


class ServedVersions:
    """The ingress's view of the registry. `lookup()` finds the AdapterRegistry actor (called once, when
    first needed: the registry may start after the ingress)."""

    def __init__(self, lookup: Callable[[], ActorHandle]):
        self._lookup = lookup
        self._registry: ActorHandle | None = None
        self.unloaded: set[int] = set()  # versions an operator unloaded: not offered until loaded again
        self.merged_version = 0  # merge mode: the base weights now are this version's
        self._sha: dict[int, str | None] = {}  # version -> the registry's digest of it

    def registry(self) -> ActorHandle:
        if self._registry is None:
            self._registry = self._lookup()
        return self._registry

    async def live(self) -> list[int]:
        """Versions new requests may use, oldest first."""
        live = await self.registry().live_versions.remote()
        return sorted(v for v in live if v not in self.unloaded)

    async def entry(self, version: int) -> dict:
        """The registry's `{"ref": [ObjectRef], "meta": dict}` of a version; raises when it does not hold it."""
        return await self.registry().get.remote(version)

    async def sha(self, version: int) -> str | None:
        """The registry's sha256 of a version (None for the original base model), cached."""
        if version <= 0:
            return None
        if version not in self._sha:
            try:
                self._sha[version] = (await self.entry(version))["meta"].get("sha256")
            except Exception:
                return None  # trimmed from the registry: nothing to compare with
        return self._sha[version]
