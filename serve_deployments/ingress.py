"""The Ingress deployment: the Serve application's entry point in front of the vLLM replicas.

Two faces, one object, each delegating to a part that is tested without Serve:
- OpenAI-compatible REST on Serve's HTTP port: /v1/completions, /v1/chat/completions, /v1/models
  (openai_front.py: bodies hardened in openai_body.py, checked and tokenized in openai_requests.py),
  /health and the bearer-token admin routes /admin/... (admin.py);
- Python handle methods for the driver, the registry and the rollout workers: `generate_group`
  (rollout_front.py), `load_adapter` / `unload_adapter` / `update_weights` / `expire` / `pause` /
  `resume` (weights_broadcaster.py), `live_versions` / `registry_sha` (served_versions.py), `stats`
  and `health` (admin.py).

Shared between them: the replica deployment's handle with the request router's RoutingPolicy and the
engine's facts (replica_pool.py), the served versions, and the in-flight limit (admission.py).
Every client error is an OpenAI-style error body, never a 5xx, and no server path leaves in one.
See docs/ARCHITECTURE.md, "Serving".
"""
from __future__ import annotations

import logging
import os

import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve_deployments.admin import ADMIN_TOKEN_ENV, AdminRoutes, ServiceStatus, parse_version
from serve_deployments.admission import Admission
from serve_deployments.openai_api import CHAT, COMPLETIONS
from serve_deployments.openai_body import DEFAULT_MAX_BODY_BYTES, add_scrub_roots, error_body, json_response
from serve_deployments.openai_front import OpenAIFront
from serve_deployments.openai_requests import RequestChecker
from serve_deployments.replica_pool import ReplicaPool
from serve_deployments.request_router import RoutingPolicy
from serve_deployments.rollout_front import RolloutFront
from serve_deployments.served_versions import ServedVersions
from serve_deployments.weights_broadcaster import WeightsBroadcaster

__all__ = ["ADMIN_TOKEN_ENV", "DEFAULT_INFLIGHT_PER_REPLICA", "Ingress", "api"]

logger = logging.getLogger("ray.serve")

DEFAULT_INFLIGHT_PER_REPLICA = 256  # rollout.max_inflight_per_replica; app_builder passes 4 x max_num_seqs

api = FastAPI(title="lora-grpo policy service")


# ---------------------------------------------------------------- app-level handlers (no 5xx for input)

@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException):
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return json_response(error_body(exc.status_code, str(exc.detail), kind), exc.status_code)


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError):
    return json_response(error_body(400, "invalid request"), 400)


@api.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception):
    logger.exception("unhandled error on %s", request.url.path)
    return json_response(error_body(500, "internal error", "server_error"), 500)


@serve.deployment(name="Ingress", max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0.1})
@serve.ingress(api)
class Ingress:
    def __init__(self, replica: DeploymentHandle, model_path: str, num_replicas: int,
                 registry_name: str, registry_namespace: str, admin_token: str | None = None,
                 routing: dict | None = None, max_inflight_per_replica: int | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        from transformers import AutoTokenizer

        # RoutingPolicy(**routing): prefix or round robin; None = Serve's own request router (serve_default).
        self._pool = ReplicaPool(replica, RoutingPolicy(**routing) if routing else None)
        self._versions = ServedVersions(lambda: ray.get_actor(registry_name, namespace=registry_namespace))
        self._admission = Admission(max(1, int(max_inflight_per_replica or DEFAULT_INFLIGHT_PER_REPLICA))
                                    * num_replicas)
        self._weights = WeightsBroadcaster(self._pool, self._versions)
        self._rollouts = RolloutFront(self._pool, self._versions, self._admission)
        checker = RequestChecker(AutoTokenizer.from_pretrained(model_path), self._admission.max_inflight)
        self._openai = OpenAIFront(self._pool, self._versions, self._admission, checker, max_body_bytes)
        self._admin = AdminRoutes(admin_token or os.environ.get(ADMIN_TOKEN_ENV), self._versions, self._weights)
        self._status = ServiceStatus(self._pool, self._versions, self._admission, num_replicas)
        add_scrub_roots(str(model_path).rstrip("/"), os.path.realpath(model_path))

    # ------------------------------------------------------------------ handle methods

    async def generate_group(self, prompt_token_ids: list[int], n: int, version: int | None = None,
                             sampling: dict | None = None, drop_if_expired: bool = False,
                             replica: str | None = None) -> list[dict]:
        """n samples of one prompt under one pinned version (rollout_front.RolloutFront.generate_group)."""
        return await self._rollouts.generate_group(prompt_token_ids, n, version, sampling, drop_if_expired,
                                                   replica)

    async def pin_version(self) -> int:
        """The version a rollout started now would pin (rollout_front.RolloutFront.pin_version)."""
        return await self._rollouts.pin_version()

    async def load_adapter(self, version: int) -> dict:
        """Load a registry version on every replica, all or nothing (weights_broadcaster.py)."""
        return await self._weights.load_adapter(version)

    async def unload_adapter(self, version: int) -> dict:
        return await self._weights.unload_adapter(version)

    async def update_weights(self, version: int) -> dict:
        return await self._weights.update_weights(version)

    async def expire(self, versions: list[int]) -> dict:
        return await self._weights.expire(versions)

    async def pause(self) -> dict:
        return await self._weights.pause()

    async def resume(self) -> dict:
        return await self._weights.resume()

    async def live_versions(self) -> list[int]:
        """Versions new requests may use, oldest first."""
        return await self._versions.live()

    async def registry_sha(self, version: int) -> str | None:
        """The registry's sha256 of a version (None for the original base model)."""
        return await self._versions.sha(version)

    async def stats(self) -> dict:
        return await self._status.stats()

    async def health(self) -> tuple[bool, dict]:
        return await self._status.health()

    # ------------------------------------------------------------------ REST: OpenAI

    @api.get("/health")
    async def http_health(self):
        ready, body = await self._status.health()
        return json_response(body, 200 if ready else 503)

    @api.get("/v1/models")
    async def http_models(self):
        return await self._openai.models()

    @api.post("/v1/completions")
    async def http_completions(self, request: Request):
        return await self._openai.complete(request, COMPLETIONS)

    @api.post("/v1/chat/completions")
    async def http_chat(self, request: Request):
        return await self._openai.complete(request, CHAT)

    # ------------------------------------------------------------------ REST: admin

    @api.post("/admin/adapters/{version}")
    async def http_load(self, version: str, request: Request):
        return await self._admin.run(request, lambda: self._admin.load(parse_version(version)))

    @api.delete("/admin/adapters/{version}")
    async def http_unload(self, version: str, request: Request):
        return await self._admin.run(request, lambda: self._weights.unload_adapter(parse_version(version)))

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
