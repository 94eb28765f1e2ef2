"""The operator's side of the ingress: bearer-token admin routes, readiness (/health) and stats.

Admin routes (/admin/...) need `Authorization: Bearer <rollout.admin_token or LORA_GRPO_ADMIN_TOKEN>`:
403 when no token is configured, 401 for a wrong or missing one, checked before anything else is parsed
(a stranger learns nothing, not even which admin routes exist). Adapters are loaded only from the
registry, by version number (`3` or `policy-v3`), never from a path. On a fleet, `RUN/policy-v3` names a
run's version, and that run's own token (FleetState) may load and unload it, besides the fleet's admin token;
another run's token is 403.

/health is 200 only when every replica answers and holds every live version (see `ServiceStatus.health`).
"""
from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response

from common.faults import short_error
from common.types import adapter_name, parse_adapter_name, parse_policy_name, split_run
from serve_deployments.admission import Admission
from serve_deployments.openai_body import APIError, json_response
from serve_deployments.replica_broadcast import AdapterLoadError, WeightsBroadcaster
from serve_deployments.replica_pool import ReplicaPool
from serve_deployments.served_versions import RunVersions, UnknownRunError

ADMIN_TOKEN_ENV = "LORA_GRPO_ADMIN_TOKEN"
HEALTH_TIMEOUT_S = 10.0
# Every route the ingress serves, with its method: another method on one of them is 405, not 404.
ROUTE_METHODS = {"/v1/completions": "POST", "/v1/chat/completions": "POST", "/v1/models": "GET", "/health": "GET",
                 "/admin/pause": "POST", "/admin/resume": "POST", "/admin/stats": "GET"}


def parse_version(text: str) -> int:
    """An admin path's version: `3` or `policy-v3`; parsed after the token check. Raises APIError."""
    if text.startswith("policy-"):
        version = parse_policy_name(text)
    else:
        version = int(text) if text.isdigit() and len(text) < 19 else None
    if version is None or version < 1:
        raise APIError(400, "not a policy version (1, 2, ... or policy-vN)", param="version")
    return version


def parse_adapter(text: str) -> tuple[str, int]:
    """An admin path's adapter: `3`, `policy-v3` (the standalone run) or `RUN/policy-v3`. Raises APIError."""
    if "/" not in text:
        return "", parse_version(text)
    parsed = parse_adapter_name(text)
    if parsed is None or parsed[1] < 1:
        raise APIError(400, "not an adapter name (policy-vN or RUN/policy-vN)", param="version")
    return parsed


def bearer(request: Request) -> str | None:
    given = request.headers.get("authorization", "")
    return given[len("Bearer "):] if given.startswith("Bearer ") else None


class AdminRoutes:
    def __init__(self, token: str | None, runs: RunVersions, weights: WeightsBroadcaster, access=None):
        self._token = token or None
        self._runs = RunVersions.of(runs)
        self._weights = weights
        self._access = access  # a fleet's FleetAccess: runs' own tokens; None for a standalone service

    def denied(self, request: Request) -> APIError | None:
        """Why `request` may not use an admin route with the admin token, or None."""
        if not self._token:
            return APIError(403, "admin disabled: set rollout.admin_token or LORA_GRPO_ADMIN_TOKEN", "permission_error")
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode("utf-8", "replace"), f"Bearer {self._token}".encode()):
            return APIError(401, "admin routes need 'Authorization: Bearer <token>'", "authentication_error")
        return None

    async def denied_for(self, request: Request, run: str) -> APIError | None:
        """Why `request` may not change run `run`'s adapters: the admin token may; on a fleet, so may the
        run's own token, and any other run's token is 403 (it may touch only its own)."""
        if self._access is None or not run or self.denied(request) is None:
            return self.denied(request)
        token = bearer(request)
        if token and await self._access.may_change(run, token):
            return None
        if token and await self._access.is_run_token(token):
            return APIError(403, f"this token may change only its own run's adapters, not run {run}'s",
                            "permission_error")
        return APIError(401, f"changing run {run}'s adapters needs 'Authorization: Bearer <its token or the "
                             "fleet's admin token>'", "authentication_error")

    async def adapter(self, request: Request, text: str, action: Callable[[int, str], Awaitable[dict]]) -> Response:
        """An admin route on one adapter (`text` from the path): the token is checked for its run first."""
        denied = await self.denied_for(request, split_run(text)[0])
        if denied:
            return denied.response()

        async def act() -> dict:
            run, version = parse_adapter(text)
            return await action(version, run)

        return await self.run(request, act, checked=True)

    async def run(self, request: Request, action: Callable[[], Awaitable[dict]], checked: bool = False) -> Response:
        """`action()`'s result as JSON when the token is right; every failure as an error body."""
        denied = None if checked else self.denied(request)
        if denied:
            return denied.response()
        try:
            return json_response(await action())
        except AdapterLoadError as e:
            return APIError(422, str(e), "adapter_rejected").response()
        except APIError as e:
            return e.response()
        except UnknownRunError as e:
            return APIError(404, e.message, "not_found_error").response()
        except Exception as e:
            return APIError(500, short_error(e), "server_error").response()

    async def load(self, version: int, run: str = "") -> dict:
        """Load a version the run's registry holds on every replica; says whether it is live now."""
        versions = self._runs.get(run)
        try:
            await versions.entry(version)
        except Exception:
            raise APIError(404, f"{adapter_name(version, run)} is not held by the registry",
                           "not_found_error") from None
        out = await self._weights.load_adapter(version, run)
        out["live"] = version in await versions.live()
        return out

    def unmatched(self, request: Request) -> Response:
        """What no route matched: under /admin the token first, then 405 for a known path, else 404."""
        path = request.url.path
        if path.startswith("/admin"):
            denied = self.denied(request)
            if denied:
                return denied.response()
        if path in ROUTE_METHODS:
            return APIError(405, f"{request.method} is not allowed here; use {ROUTE_METHODS[path]}",
                            headers={"Allow": ROUTE_METHODS[path]}).response()
        return APIError(404, "no such route", "not_found_error").response()


class ServiceStatus:
    def __init__(self, pool: ReplicaPool, runs: RunVersions, admission: Admission, num_replicas: int):
        self._pool = pool
        self._runs = RunVersions.of(runs)
        self._admission = admission
        self._num_replicas = num_replicas

    @property
    def _versions(self):
        return self._runs.base

    async def _live(self) -> dict[str, list[int]]:
        return await self._runs.live_all()

    async def health(self) -> tuple[bool, dict]:
        """Ready when every replica answers and holds every live version (the newest max_loras of them if
        more are live: a replica has no more slots, and loads an older one on demand; with the registry's
        default trim, live versions never outnumber the slots). On a fleet, every attached run's too."""
        try:
            live = await asyncio.wait_for(self._live(), HEALTH_TIMEOUT_S)
            info = await asyncio.wait_for(self._pool.engine_info(), HEALTH_TIMEOUT_S)
        except Exception as e:
            return False, {"status": "starting", "reason": f"registry or replicas not reachable ({type(e).__name__})",
                           "replicas_ready": 0, "replicas": self._num_replicas, "live": [], "missing_versions": {}}
        # Merged versions are base weights, not adapters: nothing to hold for them.
        need = {adapter_name(v, run) for run, versions in live.items() for v in versions[-info["max_loras"]:]
                if run or v > self._versions.merged_version}
        ok, errors = await self._pool.broadcast("stats", timeout_s=HEALTH_TIMEOUT_S)
        missing = {str(s.get("replica_id")): sorted(need - _held(s)) for s in ok if need - _held(s)}
        ready = not errors and len(ok) >= self._num_replicas and not missing
        reason = ("ready" if ready else
                  f"{len(errors)} replicas did not answer" if errors else
                  f"{len(ok)} of {self._num_replicas} replicas up" if len(ok) < self._num_replicas else
                  f"live versions not loaded yet on {len(missing)} replicas")
        return ready, {"status": "ok" if ready else "starting", "reason": reason,
                       "replicas_ready": len(ok) - len(missing), "replicas": self._num_replicas,
                       "live": [adapter_name(v, run) for run, versions in live.items() for v in versions],
                       "missing_versions": missing}

    async def stats(self) -> dict:
        """Request-router counters (affinity / spill / unmatched, predicted hit blocks), admission counters
        (in flight, limit, 429/413/4xx answers, version mismatches, replica retries) and every replica's
        own stats, including vLLM's prefix-cache hits and queries."""
        ok, errors = await self._pool.broadcast("stats")
        router = self._pool.router_stats()
        live = await self._live()
        return {"router": router, "replicas": sorted(ok, key=lambda s: str(s.get("replica_id"))),
                "replica_errors": [short_error(e) for e in errors],
                "prefix_cache_hits": sum(s.get("prefix_cache_hits", 0) for s in ok),
                "prefix_cache_queries": sum(s.get("prefix_cache_queries", 0) for s in ok),
                "live_versions": live.get("", []), "merged_version": self._versions.merged_version,
                "runs_live": {run: versions for run, versions in live.items() if run},
                "admission": self._admission.snapshot()}


def _held(replica_stats: dict) -> set[str]:
    """The adapter names a replica's stats say it holds (`adapters`; older replicas: `versions`)."""
    if "adapters" in replica_stats:
        return set(replica_stats["adapters"])
    return {adapter_name(v) for v in replica_stats.get("versions", [])}
