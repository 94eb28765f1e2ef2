"""The operator's side of the ingress: bearer-token admin routes, readiness (/health) and stats.

Admin routes (/admin/...) need `Authorization: Bearer <rollout.admin_token or LORA_GRPO_ADMIN_TOKEN>`:
403 when no token is configured, 401 for a wrong or missing one, checked before anything else is parsed
(a stranger learns nothing, not even which admin routes exist). Adapters are loaded only from the
registry, by version number (`3` or `policy-v3`), never from a path.

/health is 200 only when every replica answers and holds every live version (see `ServiceStatus.health`).
"""
from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response

from common.faults import short_error
from common.types import parse_policy_name, policy_name
from serve_deployments.admission import Admission
from serve_deployments.openai_body import APIError, json_response
from serve_deployments.replica_pool import ReplicaPool
from serve_deployments.served_versions import ServedVersions
from serve_deployments.weights_broadcaster import AdapterLoadError, WeightsBroadcaster

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


class AdminRoutes:
    def __init__(self, token: str | None, versions: ServedVersions, weights: WeightsBroadcaster):
        self._token = token or None
        self._versions = versions
        self._weights = weights

    def denied(self, request: Request) -> APIError | None:
        """Why `request` may not use an admin route, or None."""
        if not self._token:
            return APIError(403, "admin disabled: set rollout.admin_token or LORA_GRPO_ADMIN_TOKEN", "permission_error")
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode("utf-8", "replace"), f"Bearer {self._token}".encode()):
            return APIError(401, "admin routes need 'Authorization: Bearer <token>'", "authentication_error")
        return None

    async def run(self, request: Request, action: Callable[[], Awaitable[dict]]) -> Response:
        """`action()`'s result as JSON when the token is right; every failure as an error body."""
        denied = self.denied(request)
        if denied:
            return denied.response()
        try:
            return json_response(await action())
        except AdapterLoadError as e:
            return APIError(422, str(e), "adapter_rejected").response()
        except APIError as e:
            return e.response()
        except Exception as e:
            return APIError(500, short_error(e), "server_error").response()

    async def load(self, version: int) -> dict:
        """Load a version the registry holds on every replica; says whether it is live now."""
        try:
            await self._versions.entry(version)
        except Exception:
            raise APIError(404, f"{policy_name(version)} is not held by the registry", "not_found_error") from None
        out = await self._weights.load_adapter(version)
        out["live"] = version in await self._versions.live()
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
    def __init__(self, pool: ReplicaPool, versions: ServedVersions, admission: Admission, num_replicas: int):
        self._pool = pool
        self._versions = versions
        self._admission = admission
        self._num_replicas = num_replicas

    async def health(self) -> tuple[bool, dict]:
        """Ready when every replica answers and holds every live version (the newest max_loras of them if
        more are live: a replica has no more slots, and loads an older one on demand; with the registry's
        default trim, live versions never outnumber the slots)."""
        try:
            live = await asyncio.wait_for(self._versions.live(), HEALTH_TIMEOUT_S)
            info = await asyncio.wait_for(self._pool.engine_info(), HEALTH_TIMEOUT_S)
        except Exception as e:
            return False, {"status": "starting", "reason": f"registry or replicas not reachable ({type(e).__name__})",
                           "replicas_ready": 0, "replicas": self._num_replicas, "live": [], "missing_versions": {}}
        # Merged versions are base weights, not adapters: nothing to hold for them.
        need = {v for v in live[-info["max_loras"]:] if v > self._versions.merged_version}
        ok, errors = await self._pool.broadcast("stats", timeout_s=HEALTH_TIMEOUT_S)
        missing = {str(s.get("replica_id")): [policy_name(v) for v in sorted(need - set(s.get("versions", [])))]
                   for s in ok if need - set(s.get("versions", []))}
        ready = not errors and len(ok) >= self._num_replicas and not missing
        reason = ("ready" if ready else
                  f"{len(errors)} replicas did not answer" if errors else
                  f"{len(ok)} of {self._num_replicas} replicas up" if len(ok) < self._num_replicas else
                  f"live versions not loaded yet on {len(missing)} replicas")
        return ready, {"status": "ok" if ready else "starting", "reason": reason,
                       "replicas_ready": len(ok) - len(missing), "replicas": self._num_replicas,
                       "live": [policy_name(v) for v in live], "missing_versions": missing}

    async def stats(self) -> dict:
        """Request-router counters (affinity / spill / unmatched, predicted hit blocks), admission counters
        (in flight, limit, 429/413/4xx answers, version mismatches, replica retries) and every replica's
        own stats, including vLLM's prefix-cache hits and queries."""
        ok, errors = await self._pool.broadcast("stats")
        router = self._pool.router_stats()
        return {"router": router, "replicas": sorted(ok, key=lambda s: str(s.get("replica_id"))),
                "replica_errors": [short_error(e) for e in errors],
                "prefix_cache_hits": sum(s.get("prefix_cache_hits", 0) for s in ok),
                "prefix_cache_queries": sum(s.get("prefix_cache_queries", 0) for s in ok),
                "live_versions": await self._versions.live(), "merged_version": self._versions.merged_version,
                "admission": self._admission.snapshot()}
