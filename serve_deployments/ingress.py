"""The router deployment: the Serve application's ingress in front of the vLLM replicas.

Two faces, one object:
- OpenAI-compatible REST on Serve's HTTP port (/v1/completions, /v1/chat/completions, /v1/models,
  /health) plus bearer-token admin routes (/admin/...). Requests are validated here (4xx with a
  message; the service stays up), tokenized with the model's tokenizer (chat template for chat) to
  compute the prefix route key, and forwarded to the chosen replica's `openai` / `openai_stream`,
  where vLLM's own OpenAI serving code runs.
- Python handle methods for the driver: `generate_group`, `load_adapter` / `unload_adapter`, `pause` /
  `resume`, `update_weights`, `live_versions`, `stats`.

Routing happens in the replica handle's RequestRouter (request_router.PrefixAwareRouter): every call
that carries a prompt passes its route key as the `route` kwarg. State changes go to every replica
with `DeploymentHandle.broadcast`.

Liveness: the AdapterRegistry owns which versions are live (it marks one live only after
`load_adapter` here returned, i.e. after every replica acknowledged); this deployment only withholds
versions an operator unloaded.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from common.types import POLICY_LATEST, parse_policy_name, policy_name
from serve_deployments.prefix_hash import ROUTE_KWARG, route_key
from serve_deployments.request_router import local_policy

logger = logging.getLogger("ray.serve")

ADMIN_TOKEN_ENV = "LORA_GRPO_ADMIN_TOKEN"
BROADCAST_TIMEOUT_S = 120.0  # adapter loads: fetch + verify + add_lora on every replica
HEALTH_TIMEOUT_S = 10.0

api = FastAPI(title="lora-grpo policy service")


class APIError(Exception):
    """A client error: becomes an OpenAI-style error body with this status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.status}}, status_code=self.status)


def _version(text: str) -> int:
    """Admin path versions: `3` or `policy-v3`; parsed after the token check, so a stranger learns nothing."""
    v = parse_policy_name(text) if text.startswith("policy-") else (int(text) if text.isdigit() else None)
    if v is None or v < 1:
        raise APIError(400, f"{text!r} is not a policy version (1, 2, ... or policy-vN)", param="version")
    return v


def _per_call(kw: dict) -> dict:
    """Give each call its own id in the route key: Serve's internal request id is shared by every call
    made while serving one request, and the router tracks calls (in flight, completion) one by one."""
    return {k: dict(v, call=uuid.uuid4().hex) for k, v in kw.items()}


def _base_id(model_path: str) -> str:
    """The base model's id in /v1/models: its directory name (the path and "base" are accepted too)."""
    return os.path.basename(str(model_path).rstrip("/")) or str(model_path)


class AdapterLoadError(RuntimeError):
    """A version some replica refused; it was rolled back everywhere and is not live."""


def _short(e: BaseException) -> str:
    """The replica's own error line, not Ray's wrapped traceback."""
    cause = getattr(e, "cause", None) or e
    lines = [ln for ln in str(cause).strip().splitlines() if ln.strip()]
    return f"{type(cause).__name__}: {lines[-1] if lines else ''}".strip()


@serve.deployment(name="Router", max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0.1})
@serve.ingress(api)
class Router:
    def __init__(self, replica: DeploymentHandle, model_path: str, num_replicas: int,
                 registry_name: str, registry_namespace: str, admin_token: str | None = None,
                 router_policy: str = "prefix"):
        from transformers import AutoTokenizer

        self._replica = replica
        self._tok = AutoTokenizer.from_pretrained(model_path)
        self._num_replicas = num_replicas
        self._registry_name, self._registry_namespace = registry_name, registry_namespace
        self._registry = None
        self._admin_token = admin_token or os.environ.get(ADMIN_TOKEN_ENV) or None
        self._engine: dict | None = None
        self._unloaded: set[int] = set()
        self._merged_version = 0  # merge mode: the base weights now are this version's
        self._ctl = asyncio.Lock()  # one state change at a time: loads, unloads, weight updates
        # Serve's built-in router would pass the route key on to the replica, which takes none.
        self._routed = router_policy != "serve_default"

    # ------------------------------------------------------------------ shared pieces

    def _reg(self):
        if self._registry is None:
            import ray

            self._registry = ray.get_actor(self._registry_name, namespace=self._registry_namespace)
        return self._registry

    async def _engine_info(self) -> dict:
        if self._engine is None:
            self._engine = await self._replica.engine_info.remote()
        return self._engine

    async def live_versions(self) -> list[int]:
        """Versions new requests may use, oldest first."""
        live = await self._reg().live_versions.remote()
        return sorted(v for v in live if v not in self._unloaded)

    async def _resolve(self, version: int | None) -> int:
        live = await self.live_versions()
        if version is None:
            return live[-1] if live else self._merged_version
        if version == self._merged_version or version in live:
            return version
        raise APIError(404, f"{policy_name(version) if version > 0 else 'base'} is not live "
                            f"(live: {[policy_name(v) for v in live]})", "not_found_error", "model")

    async def _key(self, token_ids: list[int], version: int) -> dict:
        """`{ROUTE_KWARG: key}` for a replica call, or {} under Serve's built-in router."""
        if not self._routed:
            return {}
        bs = (await self._engine_info())["block_size"]
        if version > 0 and version != self._merged_version:
            return {ROUTE_KWARG: route_key(token_ids, bs, policy_name(version))}
        return {ROUTE_KWARG: route_key(token_ids, bs, None, salt=f"merged-v{version}" if version else "")}

    async def _broadcast(self, method: str, *args, timeout_s: float = BROADCAST_TIMEOUT_S
                         ) -> tuple[list, list[BaseException]]:
        try:
            results = await self._replica.broadcast(method, *args).results_async(
                timeout_s=timeout_s, return_exceptions=True)
        except (TimeoutError, asyncio.TimeoutError) as e:
            return [], [e]
        return ([r for r in results if not isinstance(r, BaseException)],
                [r for r in results if isinstance(r, BaseException)])

    # ------------------------------------------------------------------ driver API (handle methods)

    async def generate_group(self, prompt_token_ids: list[int], n: int, version: int | None = None,
                             sampling: dict | None = None) -> list[dict]:
        """n samples of one prompt as n routed requests (so they share one replica's prefix cache);
        version None = the newest live version (base model when none is live)."""
        if n < 1:
            raise ValueError(f"generate_group: n must be >= 1, got {n}")
        ids = [int(t) for t in prompt_token_ids]
        info = await self._engine_info()
        if not ids or len(ids) >= info["max_model_len"]:
            raise ValueError(f"generate_group: prompt has {len(ids)} tokens; it must be 1..{info['max_model_len'] - 1}")
        try:
            v = await self._resolve(version)
        except APIError as e:
            raise ValueError(e.message) from None
        key = await self._key(ids, v)
        req = {"prompt_token_ids": ids, "version": v, "sampling": dict(sampling or {})}
        return list(await asyncio.gather(*[self._replica.generate.remote(req, **_per_call(key))
                                           for _ in range(n)]))

    async def load_adapter(self, version: int) -> dict:
        """Load `policy-v{version}` (from the registry) on every replica. All or nothing: on any
        failure it is unloaded from the replicas that took it and the error raised; what was live
        stays live. A merged payload (merge mode) goes to `update_weights` instead: same protocol."""
        try:
            kind = (await self._reg().get.remote(version))["meta"].get("kind", "adapter")
        except Exception:
            kind = "adapter"  # the replicas answer the clear "registry does not hold it" error
        if kind == "merged":
            return await self.update_weights(version)
        async with self._ctl:
            t0 = time.perf_counter()
            ok, errors = await self._broadcast("load_adapter", version)
            if errors or not ok:
                _, undo_errors = await self._broadcast("unload_adapter", version)
                why = "; ".join(sorted({_short(e) for e in errors})) or "no replica answered"
                if undo_errors:
                    why += f" (rollback failed on {len(undo_errors)}: {_short(undo_errors[0])})"
                raise AdapterLoadError(f"{policy_name(version)} rejected by {len(errors)} of "
                                       f"{len(ok) + len(errors)} replicas, rolled back: {why}")
            self._unloaded.discard(version)
            return {"version": version, "name": policy_name(version), "replicas": len(ok),
                    "seconds": time.perf_counter() - t0, "results": ok}

    async def unload_adapter(self, version: int) -> dict:
        """Stop offering a version and drop it from every replica (in-flight requests finish first:
        the replicas' slot managers never evict an adapter in use)."""
        async with self._ctl:
            self._unloaded.add(version)
            ok, errors = await self._broadcast("unload_adapter", version)
            if errors:
                raise RuntimeError(f"unload {policy_name(version)}: {len(errors)} replicas failed: {_short(errors[0])}")
            return {"version": version, "replicas": len(ok)}

    async def update_weights(self, version: int) -> dict:
        """Merge mode: every replica swaps in the merged weights of `version`."""
        async with self._ctl:
            ok, errors = await self._broadcast("update_weights", version)
            if errors or not ok:
                raise RuntimeError(f"update_weights v{version} failed on {len(errors)} of "
                                   f"{len(ok) + len(errors)} replicas: {_short(errors[0]) if errors else 'none answered'}")
            # New base weights: old base-model blocks are stale on every replica, so new hashes.
            self._merged_version = version
            return {"version": version, "replicas": len(ok), "results": ok}

    async def pause(self) -> dict:
        ok, errors = await self._broadcast("pause")
        if errors:
            raise RuntimeError(f"pause failed on {len(errors)} replicas: {_short(errors[0])}")
        return {"paused": len(ok)}

    async def resume(self) -> dict:
        ok, errors = await self._broadcast("resume")
        if errors:
            raise RuntimeError(f"resume failed on {len(errors)} replicas: {_short(errors[0])}")
        return {"resumed": len(ok)}

    async def stats(self) -> dict:
        """Router counters (affinity / spill / unmatched, predicted hit blocks) and every replica's
        own stats, including vLLM's prefix-cache hits and queries."""
        ok, errors = await self._broadcast("stats")
        policy = local_policy(self._replica.app_name, self._replica.deployment_name)
        if policy is None:
            router = {"policy": "serve_default"}
        else:
            with policy.lock:
                router = policy.snapshot()
        hits = sum(s.get("prefix_cache_hits", 0) for s in ok)
        queries = sum(s.get("prefix_cache_queries", 0) for s in ok)
        return {"router": router, "replicas": sorted(ok, key=lambda s: str(s.get("replica_id"))),
                "replica_errors": [_short(e) for e in errors],
                "prefix_cache_hits": hits, "prefix_cache_queries": queries,
                "live_versions": await self.live_versions(), "merged_version": self._merged_version}

    async def health(self) -> tuple[bool, dict]:
        """Ready when every replica answers and holds every live version (the newest max_loras of
        them: a replica has no more slots, and loads an older one on demand)."""
        live = await self.live_versions()
        # Merged versions are base weights, not adapters: nothing to hold for them.
        need = {v for v in live[-(await self._engine_info())["max_loras"]:] if v > self._merged_version}
        ok, errors = await self._broadcast("stats", timeout_s=HEALTH_TIMEOUT_S)
        missing = {str(s.get("replica_id")): sorted(need - set(s.get("versions", [])))
                   for s in ok if need - set(s.get("versions", []))}
        ready = not errors and len(ok) >= self._num_replicas and not missing
        return ready, {"status": "ok" if ready else "starting", "replicas_ready": len(ok) - len(missing),
                       "replicas": self._num_replicas, "live": [policy_name(v) for v in live],
                       "missing_versions": missing, "errors": [_short(e) for e in errors]}

    # ------------------------------------------------------------------ REST: OpenAI

    @api.get("/health")
    async def http_health(self):
        ready, body = await self.health()
        return JSONResponse(body, status_code=200 if ready else 503)

    @api.get("/v1/models")
    async def http_models(self):
        info, live = await self._engine_info(), await self.live_versions()
        now = int(time.time())
        card = lambda mid, parent=None: {"id": mid, "object": "model", "created": now,  # noqa: E731
                                         "owned_by": "lora-grpo", "root": mid, "parent": parent,
                                         "max_model_len": info["max_model_len"]}
        base = _base_id(info["model"])
        data = [card(base)] + [card(policy_name(v), base) for v in live]
        if live:
            data.append(card(POLICY_LATEST, base))
        return {"object": "list", "data": data}

    @api.post("/v1/completions")
    async def http_completions(self, request: Request):
        return await self._openai(request, "/v1/completions")

    @api.post("/v1/chat/completions")
    async def http_chat(self, request: Request):
        return await self._openai(request, "/v1/chat/completions")

    async def _openai(self, request: Request, path: str):
        try:
            body = await self._body(request)
            token_ids, version = await self._validate(body, chat=path.endswith("chat/completions"))
            key = await self._key(token_ids, version)
        except APIError as e:
            return e.response()
        if body.get("stream"):
            gen = self._replica.options(stream=True).openai_stream.remote(path, body, **_per_call(key))
            return StreamingResponse(self._relay(gen), media_type="text/event-stream")
        try:
            out = await self._replica.openai.remote(path, body, **_per_call(key))
        except Exception as e:  # the engine failed this request; the service itself is fine
            logger.warning("replica failed %s: %s", path, _short(e))
            return APIError(500, _short(e), "server_error").response()
        err = out.get("error") if isinstance(out, dict) else None
        if isinstance(err, dict):  # vLLM's ErrorResponse, with its own status code
            status = int(out.pop("status_code", None) or err.get("code") or 400)
            return JSONResponse(out, status_code=status)
        return JSONResponse(out)

    @staticmethod
    async def _relay(gen):
        try:
            async for chunk in gen:
                yield chunk
        except Exception as e:  # headers are sent: report in-band, the way vLLM does
            yield f"data: {json.dumps({'error': {'message': _short(e), 'type': 'server_error', 'code': 500}})}\n\n"
            yield "data: [DONE]\n\n"

    @staticmethod
    async def _body(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise APIError(400, f"request body must be a JSON object, got {type(body).__name__}")
        return body

    async def _validate(self, body: dict, chat: bool) -> tuple[list[int], int]:
        """Check what the router can check before a replica sees it; rewrite the model alias; return
        the (first) prompt's token ids and the version it runs under."""
        info = await self._engine_info()
        version = await self._model_version(body.get("model"), info["model"])
        body["model"] = info["model"] if version == 0 else policy_name(version)
        for field in ("max_tokens", "max_completion_tokens"):
            v = body.get(field)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise APIError(400, f"{field} must be a positive integer, got {v!r}", param=field)
        prompts = self._chat_ids(body) if chat else self._completion_ids(body.get("prompt"))
        limit = info["max_model_len"]
        max_new = body.get("max_completion_tokens") or body.get("max_tokens") or 0
        for ids in prompts:
            if len(ids) >= limit or len(ids) + max_new > limit:
                raise APIError(400, f"prompt is {len(ids)} tokens and max_tokens {max_new}; the context "
                                    f"is {limit} tokens (prompt + completion must fit)", param="prompt")
        return prompts[0], version

    async def _model_version(self, model, base: str) -> int:
        if model in (None, "", "base", base, _base_id(base)):
            return self._merged_version
        if not isinstance(model, str):
            raise APIError(400, "model must be a string", param="model")
        live = await self.live_versions()
        if model == POLICY_LATEST:
            if not live:
                raise APIError(404, f"{POLICY_LATEST}: no policy version is live yet", "not_found_error", "model")
            return live[-1]
        v = parse_policy_name(model)
        if v is None or v not in live:
            names = [_base_id(base)] + [policy_name(x) for x in live] + ([POLICY_LATEST] if live else [])
            raise APIError(404, f"model {model!r} does not exist; serving: {', '.join(names)}",
                           "not_found_error", "model")
        return v

    def _completion_ids(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self._tok(prompt)["input_ids"]]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return [list(prompt)]
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            return [self._tok(p)["input_ids"] for p in prompt]
        if isinstance(prompt, list) and prompt and all(
                isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
            return [list(p) for p in prompt]
        raise APIError(400, "prompt must be a non-empty string, list of strings, or token id list(s)", param="prompt")

    def _chat_ids(self, body: dict) -> list[list[int]]:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and "role" in m for m in msgs):
            raise APIError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
        try:
            ids = self._tok.apply_chat_template(
                msgs, tokenize=True, return_dict=False,
                add_generation_prompt=body.get("add_generation_prompt", True),
                continue_final_message=body.get("continue_final_message", False),
                **(body.get("chat_template_kwargs") or {}))
        except Exception as e:
            raise APIError(400, f"messages could not be rendered with the chat template: {e}", param="messages") from None
        return [list(ids)]

    # ------------------------------------------------------------------ REST: admin

    def _admin_check(self, request: Request) -> APIError | None:
        if not self._admin_token:
            return APIError(403, "admin disabled: set rollout.admin_token or LORA_GRPO_ADMIN_TOKEN", "permission_error")
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self._admin_token}".encode()):
            return APIError(401, "admin routes need 'Authorization: Bearer <token>'", "authentication_error")
        return None

    async def _admin(self, request: Request, action):
        denied = self._admin_check(request)
        if denied:
            return denied.response()
        try:
            return JSONResponse(await action())
        except AdapterLoadError as e:
            return APIError(422, str(e), "adapter_rejected").response()
        except APIError as e:
            return e.response()
        except Exception as e:
            return APIError(500, _short(e), "server_error").response()

    @api.post("/admin/adapters/{version}")
    async def http_load(self, version: str, request: Request):
        return await self._admin(request, lambda: self._admin_load(_version(version)))

    async def _admin_load(self, version: int) -> dict:
        try:  # adapters come only from the registry, by version
            await self._reg().get.remote(version)
        except Exception:
            raise APIError(404, f"{policy_name(version)} is not held by the registry", "not_found_error") from None
        out = await self.load_adapter(version)
        out["live"] = version in await self.live_versions()
        return out

    @api.delete("/admin/adapters/{version}")
    async def http_unload(self, version: str, request: Request):
        return await self._admin(request, lambda: self.unload_adapter(_version(version)))

    @api.post("/admin/pause")
    async def http_pause(self, request: Request):
        return await self._admin(request, self.pause)

    @api.post("/admin/resume")
    async def http_resume(self, request: Request):
        return await self._admin(request, self.resume)

    @api.get("/admin/stats")
    async def http_stats(self, request: Request):
        return await self._admin(request, self.stats)
