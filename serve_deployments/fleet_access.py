"""Who may do what on a fleet's ingress, as FleetState says, cached for a few seconds (docs/FLEET.md,
"Isolation").

Every rollout call and adapter change of an attached run carries the run's token; REST reads carry the
fleet's read token when one is set. Asking the FleetState actor each time would put an actor call on every
request, so answers are cached per (question, token digest) for `ttl_s`: a token revoked by a run leaving
stops working within that time (the run's adapters are unloaded as it leaves anyway).
"""
from __future__ import annotations

import time
from collections.abc import Callable

from serve_deployments.fleet_state import FleetError, digest

CACHE_TTL_S = 5.0


class FleetAccess:
    def __init__(self, lookup: Callable[[], object], ttl_s: float = CACHE_TTL_S):
        self._lookup = lookup  # the FleetState actor handle, found when first needed
        self._state = None
        self._ttl = ttl_s
        self._cache: dict[tuple, tuple[float, bool]] = {}

    def state(self):
        if self._state is None:
            self._state = self._lookup()
        return self._state

    async def _ask(self, key: tuple, call) -> bool:
        hit = self._cache.get(key)
        now = time.monotonic()
        if hit is not None and hit[0] > now:
            return hit[1]
        try:
            answer = bool(await call())
        except Exception:
            self._state = None  # a FleetState being restarted: deny now, ask again next time
            return False
        if len(self._cache) > 4096:
            self._cache.clear()
        self._cache[key] = (now + self._ttl, answer)
        return answer

    async def may_read(self, token: str | None) -> bool:
        return await self._ask(("read", digest(token)), lambda: self.state().check_read.remote(token))

    async def may_change(self, run: str, token: str | None) -> bool:
        return await self._ask(("change", run, digest(token)), lambda: self.state().authorize.remote(run, token))

    async def is_run_token(self, token: str | None) -> bool:
        """A token of some attached run (to answer 403, not 401, when it names another run)."""
        return await self._ask(("anyrun", digest(token)), lambda: self.state().is_run_token.remote(token))

    async def require_change(self, run: str, token: str | None) -> None:
        """Raise FleetError 403 unless `token` may change run `run`'s adapters."""
        if not await self.may_change(run, token):
            raise FleetError(f"this token may not change run {run}'s adapters", 403)

    def forget(self, run: str) -> None:
        self._cache = {k: v for k, v in self._cache.items() if not (k[0] == "change" and k[1] == run)}
