"""The Ingress deployment: the Serve application's entry point in front of the vLLM replicas.

Two faces, one object, each delegating to a part that is tested without Serve:
- OpenAI-compatible REST on Serve's HTTP port: /v1/completions, /v1/chat/completions, /v1/models
  (openai_routes.py: bodies hardened in openai_body.py, checked and tokenized in openai_requests.py),
  /health and the bearer-token admin routes /admin/... (admin.py);
- Python handle methods for the driver, the registry and the rollout workers: `generate_group`
  (rollout_groups.py), `load_adapter` / `unload_adapter` / `update_weights` / `expire` / `pause` /
  `resume` (replica_broadcast.py), `live_versions` / `registry_sha` (served_versions.py), `stats`
  and `health` (admin.py).

Shared between them: the replica deployment's handle with the request router's RoutingPolicy and the
engine's facts (replica_pool.py), the served versions, and the in-flight limit (admission.py).

A fleet's ingress (`fleet` set; docs/FLEET.md) serves every attached run: the run's versions come from its
own registry (`run_namespace(run)`), a run's calls name it (`run=`) and its adapter changes carry its token
(fleet_access.py), rollout groups are admitted by weighted fair queuing (fair_queue.py), and FleetState
attaches and forgets runs through `attach_run` / `forget_run`.
Every client error is an OpenAI-style error body, never a 5xx, and no server path leaves in one.
See docs/ARCHITECTURE.md, "Serving".
"""
from __future__ import annotations

import os
import time

import ray
from fastapi import FastAPI, Request
from ray import serve
from ray.serve.handle import DeploymentHandle

from common.names import NAMESPACE, REGISTRY_NAME, fleet_app, run_namespace
from serve_deployments.admin import ADMIN_TOKEN_ENV, AdminRoutes, ServiceStatus, bearer
from serve_deployments.admission import Admission
from serve_deployments.fair_queue import FairQueue
from serve_deployments.fleet_access import FleetAccess
from serve_deployments.openai_api import CHAT, COMPLETIONS
from serve_deployments.openai_body import (
    DEFAULT_MAX_BODY_BYTES,
    add_scrub_roots,
    error_body,
    install_error_handlers,
    json_response,
)
from serve_deployments.openai_requests import RequestChecker
from serve_deployments.openai_routes import OpenAIRoutes
from serve_deployments.replica_broadcast import WeightsBroadcaster
from serve_deployments.replica_pool import ReplicaPool
from serve_deployments.request_router import RoutingPolicy
from serve_deployments.rollout_groups import RolloutGroups
from serve_deployments.served_versions import RunVersions
from serve_deployments.token_generate import TokenGenerate

__all__ = ["ADMIN_TOKEN_ENV", "DEFAULT_INFLIGHT_PER_REPLICA", "Ingress", "api"]

DEFAULT_INFLIGHT_PER_REPLICA = 256  # rollout.max_inflight_per_replica; app_builder passes 4 x max_num_seqs

api = FastAPI(title="lora-grpo policy service")


install_error_handlers(api)  # no 5xx for input


@serve.deployment(name="Ingress", max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0.1})
@serve.ingress(api)
class Ingress:
    def __init__(self, replica: DeploymentHandle, model_path: str, num_replicas: int,
                 registry_name: str, registry_namespace: str, admin_token: str | None = None,
                 routing: dict | None = None, max_inflight_per_replica: int | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, fleet: str | None = None,
                 fleet_seqs: int | None = None):
        from transformers import AutoTokenizer

        def registry_of(run: str):
            if not run:  # a fleet serves no adapter of its own: its run "" is the base model only
                return None if fleet else ray.get_actor(registry_name, namespace=registry_namespace)
            return ray.get_actor(REGISTRY_NAME, namespace=run_namespace(run))

        self._fleet = fleet
        # RoutingPolicy(**routing): prefix or round robin; None = Serve's own request router (serve_default).
        self._pool = ReplicaPool(replica, RoutingPolicy(**routing) if routing else None)
        self._runs = RunVersions(registry_of)
        self._admission = Admission(max(1, int(max_inflight_per_replica or DEFAULT_INFLIGHT_PER_REPLICA))
                                    * num_replicas)
        self._access = FleetAccess(lambda: ray.get_actor(fleet_app(fleet), namespace=NAMESPACE)) if fleet else None
        # A fleet admits rollout groups by weighted fair queuing over the replicas' sequences in flight.
        self._fair = FairQueue(max(1, int(fleet_seqs or 256))) if fleet else None
        if self._fair is not None:
            self._fair.set_weight("", 1.0)
        self._synced_at = 0.0
        self._weights = WeightsBroadcaster(self._pool, self._runs)
        self._rollouts = RolloutGroups(self._pool, self._runs, self._admission, fair=self._fair)
        checker = RequestChecker(AutoTokenizer.from_pretrained(model_path), self._admission.max_inflight)
        self._openai = OpenAIRoutes(self._pool, self._runs, self._admission, checker, max_body_bytes)
        self._tokens = TokenGenerate(self._pool, self._runs, self._rollouts, max_body_bytes)
        self._admin = AdminRoutes(admin_token or os.environ.get(ADMIN_TOKEN_ENV), self._runs, self._weights,
                                  self._access)
        self._status = ServiceStatus(self._pool, self._runs, self._admission, num_replicas)
        add_scrub_roots(str(model_path).rstrip("/"), os.path.realpath(model_path))

    async def _known(self, run: str) -> None:
        """A fleet ingress that restarted learns the attached runs back from FleetState (at most every 2 s)."""
        if not run or self._fleet is None or run in self._runs.runs() or time.monotonic() - self._synced_at < 2:
            return
        self._synced_at = time.monotonic()
        try:
            runs = await self._access.state().runs.remote()
        except Exception:
            return
        for name, r in runs.items():
            if name not in self._runs.runs():
                self._runs.add(name)
                self._fair.set_weight(name, r.get("weight", 1.0))

    async def _may_change(self, run: str, token: str | None) -> None:
        if run and self._access is not None:
            await self._access.require_change(run, token)

    # ------------------------------------------------------------------ handle methods

    async def generate_group(self, prompt_token_ids: list[int], n: int, version: int | None = None,
                             sampling: dict | None = None, drop_if_expired: bool = False,
                             replica: str | None = None, run: str = "", partial: str | None = None,
                             partial_limit: int | None = None) -> list[dict]:
        """n samples of one prompt under one pinned version (rollout_groups.RolloutGroups.generate_group)."""
        await self._known(run)
        return await self._rollouts.generate_group(prompt_token_ids, n, version, sampling, drop_if_expired,
                                                   replica, run, partial, partial_limit)

    async def pin_version(self, run: str = "") -> int:
        """The version a rollout started now would pin (rollout_groups.RolloutGroups.pin_version)."""
        await self._known(run)
        return await self._rollouts.pin_version(run)

    async def load_adapter(self, version: int, run: str = "", token: str | None = None) -> dict:
        """Load a registry version on every replica, all or nothing (replica_broadcast.py). On a fleet, a
        run's version needs its token."""
        await self._may_change(run, token)
        await self._known(run)
        return await self._weights.load_adapter(version, run)

    async def unload_adapter(self, version: int, run: str = "", token: str | None = None) -> dict:
        await self._may_change(run, token)
        return await self._weights.unload_adapter(version, run)

    async def update_weights(self, version: int) -> dict:
        return await self._weights.update_weights(version)

    async def expire(self, versions: list[int], run: str = "", token: str | None = None) -> dict:
        await self._may_change(run, token)
        return await self._weights.expire(versions, run)

    # ------------------------------------------------------------------ fleet (FleetState calls these)

    async def attach_run(self, run: str, slots: int, weight: float = 1.0) -> dict:
        """A run joins the fleet: its versions are offered, its quota set on every replica, its weight in
        the fair queue."""
        self._runs.add(run)
        self._fair.set_weight(run, weight)
        return await self._weights.set_quota(run, slots)

    async def forget_run(self, run: str) -> dict:
        """A run left: its queued groups fail, its adapters are unloaded everywhere, its names are gone."""
        if self._fair is not None:
            self._fair.forget(run)
        self._access.forget(run)
        out = await self._weights.forget_run(run)
        self._runs.drop(run)
        return out

    async def fleet_stats(self) -> dict:
        """Per run: tokens generated and their share, groups queued; the fair queue's sequences in flight."""
        if self._fair is None:
            return {}
        queued = self._fair.queued()
        return {"runs": {run: {"tokens": self._fair.tokens.get(run, 0), "share": share, "queued": queued.get(run, 0),
                               "weight": self._fair.weights.get(run)}
                         for run, share in {**{r: 0.0 for r in self._fair.weights}, **self._fair.shares()}.items()},
                "inflight": self._fair.inflight, "capacity": self._fair.capacity}

    async def pause(self) -> dict:
        return await self._weights.pause()

    async def resume(self) -> dict:
        return await self._weights.resume()

    async def live_versions(self, run: str = "") -> list[int]:
        """Versions new requests may use, oldest first."""
        await self._known(run)
        return await self._runs.get(run).live()

    async def registry_sha(self, version: int, run: str = "") -> str | None:
        """The registry's sha256 of a version (None for the original base model)."""
        return await self._runs.get(run).sha(version)

    async def stats(self) -> dict:
        return await self._status.stats()

    async def health(self) -> tuple[bool, dict]:
        return await self._status.health()

    # ------------------------------------------------------------------ REST: OpenAI

    @api.get("/health")
    async def http_health(self):
        ready, body = await self._status.health()
        return json_response(body, 200 if ready else 503)

    async def _read_denied(self, request: Request):
        """On a fleet with a read token, reading needs it (or the admin token, or a run's token)."""
        if self._access is None or await self._access.may_read(bearer(request)):
            return None
        return json_response(error_body(401, "reading this fleet needs 'Authorization: Bearer <read token>'",
                                        "authentication_error"), 401)

    @api.get("/v1/models")
    async def http_models(self, request: Request):
        return await self._read_denied(request) or await self._openai.models()

    @api.post("/v1/completions")
    async def http_completions(self, request: Request):
        return await self._read_denied(request) or await self._openai.complete(request, COMPLETIONS)

    @api.post("/v1/chat/completions")
    async def http_chat(self, request: Request):
        return await self._read_denied(request) or await self._openai.complete(request, CHAT)

    @api.post("/inference/v1/generate")
    async def http_token_generate(self, request: Request):
        return await self._read_denied(request) or await self._tokens.generate(request)

    # ------------------------------------------------------------------ REST: admin

    @api.post("/admin/adapters/{version:path}")
    async def http_load(self, version: str, request: Request):
        return await self._admin.adapter(request, version, self._admin.load)

    @api.delete("/admin/adapters/{version:path}")
    async def http_unload(self, version: str, request: Request):
        return await self._admin.adapter(request, version, self._weights.unload_adapter)

    @api.post("/admin/pause")
    async def http_pause(self, request: Request):
        return await self._admin.run(request, self._weights.pause)

    @api.post("/admin/resume")
    async def http_resume(self, request: Request):
        return await self._admin.run(request, self._weights.resume)

    @api.get("/admin/stats")
    async def http_stats(self, request: Request):
        return await self._admin.run(request, self._status.stats)

    # Last: whatever no route above matched. Under /admin a stranger learns nothing (401/403 first).
    @api.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
    async def http_unmatched(self, rest: str, request: Request):
        return self._admin.unmatched(request)
