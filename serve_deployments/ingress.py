"""The Ingress deployment: the Serve application's entry point in front of the vLLM replicas.

Two faces, one object:
- OpenAI-compatible REST on Serve's HTTP port (/v1/completions, /v1/chat/completions, /v1/models,
  /health) plus bearer-token admin routes (/admin/...). Requests are validated here, tokenized with
  the model's tokenizer (chat template for chat) to compute the prefix route key, and forwarded to
  the chosen replica's `openai` / `openai_stream`, where vLLM's own OpenAI serving code runs.
- Python handle methods for the driver: `generate_group`, `load_adapter` / `unload_adapter`, `pause` /
  `resume`, `update_weights`, `live_versions`, `stats`, `health`.

Hostile input (every case answers an OpenAI-style `{"error": {message, type, param, code}}`, never a
5xx, and the service stays up):
- bodies over `rollout.max_body_bytes` -> 413 before parsing; not strict UTF-8 JSON, NaN/Infinity,
  lone surrogates, nesting deeper than MAX_DEPTH, integers outside int64 -> 400;
- model names: `base`, the model directory's name, `policy-vN`, `policy-latest`; anything path-like
  -> 400 (never echoed), unknown -> 404; the server's paths never appear in a response (`model` is
  the public id of the version that served it, error messages are scrubbed);
- wrong types / ranges / context overflow / malformed chat messages -> 400 (here or from vLLM's own
  validation on the replica, whose status is passed through);
- unknown routes and methods -> 404 / 405 (401 under /admin without the token);
- overload: REST + rollout calls in flight are capped at `max_inflight_per_replica` x replicas; a REST
  request over the cap gets 429 with Retry-After instead of queueing without bound.

Served-version proof: a completion's `model` is the exact version that produced it (`policy-vN` also
when `policy-latest` was asked, `base` for the base model) and the response carries
`x-policy-version` and `x-adapter-sha256` (the digest of the adapter the replica used).

Routing: this deployment owns the RoutingPolicy (router.policy prefix or round_robin; its counters are
`stats()["router"]`). Every replica call goes through replica_calls.ReplicaCall: a call that carries a
prompt brings a RouteTicket (policy + route key) to `choose_replica`, where the replica deployment's
PolicyRouter asks it. State changes go to every replica with `DeploymentHandle.broadcast`.

Liveness: the AdapterRegistry owns which versions are live (it marks one live only after
`load_adapter` here returned, i.e. after every replica acknowledged); this deployment only withholds
versions an operator unloaded. `/health` is 200 only when every replica holds every live version.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import os
import re
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.names import BASE_NAME
from common.types import POLICY_LATEST, parse_policy_name, policy_name
from serve_deployments import openai_api
from serve_deployments.openai_api import (
    ModelNameError,
    base_id,
    openai_type,
    resolve_model,
    resolve_version,
    served_name,
)
from serve_deployments.prefix_hash import route_key
from serve_deployments.replica_calls import ReplicaCall, call_replica
from serve_deployments.request_router import RouteTicket, RoutingPolicy
from serve_deployments.weight_transport import payload_kind

logger = logging.getLogger("ray.serve")

ADMIN_TOKEN_ENV = "LORA_GRPO_ADMIN_TOKEN"
BROADCAST_TIMEOUT_S = 120.0  # adapter loads: fetch + verify + add_lora on every replica
HEALTH_TIMEOUT_S = 10.0
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_INFLIGHT_PER_REPLICA = 256  # rollout.max_inflight_per_replica; app_builder passes 4 x max_num_seqs
RETRY_AFTER_S = 1
BODY_TIMEOUT_S = 30.0  # a body that trickles in slower than this is answered 408, not waited on forever
MAX_DEPTH = 32  # JSON nesting; chat messages with tool schemas need < 10
INT64 = 2 ** 63 - 1  # vLLM turns sampling integers into int64 tensors; larger ones overflow in the engine
ROLES = ("system", "developer", "user", "assistant", "tool")
# apply_chat_template arguments a client's chat_template_kwargs must not override.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})
# Absolute paths with 2+ components (not our own routes): scrubbed from every message that leaves.
_ABS_PATH = re.compile(r"(?<![\w.:/])/(?!v1/|admin/)[\w.\-~]+(?:/[\w.\-~]*)+")

api = FastAPI(title="lora-grpo policy service")


def _json(body, status: int = 200, headers: dict | None = None) -> Response:
    """JSON with non-ASCII escaped: a response can never fail to encode (no 500 after the fact)."""
    return Response(json.dumps(body, ensure_ascii=True), status_code=status, headers=headers,
                    media_type="application/json")


def error_body(status: int, message: str, type_: str | None = None, param: str | None = None) -> dict:
    """openai_api.error_body with the message scrubbed of server paths (every error leaves through here)."""
    return openai_api.error_body(status, _scrub(message), type_, param)


class APIError(Exception):
    """A client error: becomes an OpenAI-style error body with this status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers

    def response(self) -> Response:
        return _json(error_body(self.status, self.message, self.type, self.param), self.status, self.headers)


# The model directory (and its real path), added by the Ingress. Everything the Ingress class uses must
# be defined above it: Serve pickles the ingress class by value when it is decorated.
_SCRUB_ROOTS: list[str] = []


def _add_scrub_roots(*roots: str) -> None:
    for root in roots:
        if len(root) > 1 and root not in _SCRUB_ROOTS:
            _SCRUB_ROOTS.append(root)
    _SCRUB_ROOTS.sort(key=len, reverse=True)


def _scrub(message: str) -> str:
    """No server path leaves this process: the model dir becomes its public id, other paths <path>."""
    message = str(message)
    for root in _SCRUB_ROOTS:
        message = message.replace(root, BASE_NAME)
    return _ABS_PATH.sub("<path>", message)


def _overloaded(limit: int) -> APIError:
    return APIError(429, f"server busy: {limit} requests in flight (the limit); retry after {RETRY_AFTER_S}s",
                    "rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_S)})


# ---------------------------------------------------------------- app-level handlers (no 5xx for input)

@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException):
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return _json(error_body(exc.status_code, str(exc.detail), kind), exc.status_code)


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError):
    return _json(error_body(400, "invalid request"), 400)


@api.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception):
    logger.exception("unhandled error on %s", request.url.path)
    return _json(error_body(500, "internal error", "server_error"), 500)


def _version(text: str) -> int:
    """Admin path versions: `3` or `policy-v3`; parsed after the token check, so a stranger learns nothing."""
    v = parse_policy_name(text) if text.startswith("policy-") else (int(text) if text.isdigit() and len(text) < 19
                                                                     else None)
    if v is None or v < 1:
        raise APIError(400, "not a policy version (1, 2, ... or policy-vN)", param="version")
    return v


class AdapterLoadError(RuntimeError):
    """A version some replica refused; it was rolled back everywhere and is not live."""


# Rollout calls that lose their replica (SIGKILL, OOM, node loss) are retried through the handle, which
# routes to a live replica; the version stays pinned (a replica lacking it loads it from the registry).
REPLICA_RETRY_ATTEMPTS = 5
REPLICA_RETRY_BACKOFF_S = 0.5  # doubled per attempt, capped at 4 s
REPLICA_RETRY_DEADLINE_S = 180.0


def _replica_lost(e: BaseException) -> bool:
    """True when a call failed because its replica (actor) died or went away, not because the replica
    refused the request (a ReplicaError with a status the replica raised on purpose)."""
    import ray.exceptions as rex
    from ray.serve import exceptions as sex

    lost = (rex.RayActorError, rex.ActorUnschedulableError, sex.ReplicaUnavailableError,
            sex.DeploymentUnavailableError)
    for err in (e, getattr(e, "cause", None)):
        if err is None or isinstance(getattr(err, "status_code", None), int):
            continue
        if isinstance(err, lost):
            return True
    return False


def _short(e: BaseException) -> str:
    """The replica's own error line, not Ray's wrapped traceback."""
    cause = getattr(e, "cause", None) or e
    lines = [ln for ln in str(cause).strip().splitlines() if ln.strip()]
    return f"{type(cause).__name__}: {lines[-1] if lines else ''}".strip()


def _reject_non_finite(text: str):
    raise ValueError(f"{text} is not valid JSON (numbers must be finite)")


def _finite_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(f"number {text[:32]} is out of range")
    return x


def _check_tree(body) -> None:
    """Every string valid UTF-8 (no lone surrogates), every integer within int64, nesting bounded."""
    stack = [(body, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise APIError(400, f"request body nests deeper than {MAX_DEPTH} levels")
        if isinstance(node, str):
            _check_str(node)
        elif isinstance(node, bool) or node is None or isinstance(node, float):
            pass
        elif isinstance(node, int):
            if not -INT64 - 1 <= node <= INT64:
                raise APIError(400, "integer out of range (at most 64-bit integers are accepted)")
        elif isinstance(node, dict):
            for k, v in node.items():
                _check_str(k)
                stack.append((v, depth + 1))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)


def _check_str(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "request body contains an invalid string (a lone UTF-16 surrogate such as \\ud800)"
                       ) from None


def _int_field(body: dict, field: str, lo: int, hi: int) -> int | None:
    v = body.get(field)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise APIError(400, f"{field} must be an integer in [{lo}, {hi}], got {_show(v)}", param=field)
    return v


def _show(v) -> str:
    text = json.dumps(v, ensure_ascii=True)
    return text if len(text) <= 40 else text[:37] + "..."


class _Once:
    """Runs its function once, however often called (the in-flight slot of one request)."""

    def __init__(self, fn):
        self._fn = fn

    def __call__(self):
        fn, self._fn = self._fn, None
        if fn is not None:
            fn()


def _sse_error(chunk) -> dict | None:
    """The error dict of an SSE `data: {"error": ...}` chunk, else None."""
    if not isinstance(chunk, str) or not chunk.startswith("data: {") or '"error"' not in chunk[:64]:
        return None
    try:
        obj = json.loads(chunk[len("data: "):])
    except ValueError:
        return None
    return obj if isinstance(obj, dict) and isinstance(obj.get("error"), dict) and "choices" not in obj else None


def _check_messages(msgs) -> list[dict]:
    """Chat messages of the shape OpenAI accepts: {role, content} with a known role and text content
    (a string or a list of {type: text, text} parts; assistant turns with tool_calls may omit it)."""
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise APIError(400, f"messages[{i}] must be an object with role and content", param="messages")
        if m.get("role") not in ROLES:
            raise APIError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}", param="messages")
        c = m.get("content")
        if isinstance(c, list) and c and all(isinstance(p, dict) and p.get("type") == "text"
                                             and isinstance(p.get("text"), str) for p in c):
            m = dict(m, content="\n".join(p["text"] for p in c))  # how vLLM joins text parts
        elif not (isinstance(c, str) or (c is None and m["role"] == "assistant" and m.get("tool_calls"))):
            raise APIError(400, f"messages[{i}].content must be a string or a list of text parts "
                                "({type: text, text: string})", param="messages")
        if "name" in m and not isinstance(m["name"], str):
            raise APIError(400, f"messages[{i}].name must be a string", param="messages")
        out.append(m)
    return out


@serve.deployment(name="Ingress", max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0.1})
@serve.ingress(api)
class Ingress:
    def __init__(self, replica: DeploymentHandle, model_path: str, num_replicas: int,
                 registry_name: str, registry_namespace: str, admin_token: str | None = None,
                 routing: dict | None = None, max_inflight_per_replica: int | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        from transformers import AutoTokenizer

        self._replica = replica
        self._tok = AutoTokenizer.from_pretrained(model_path)
        self._vocab = len(self._tok)
        # A prompt of more characters than this cannot fit the context: refused without tokenizing.
        self._max_token_chars = max(1, max((len(t) for t in self._tok.get_vocab()), default=1))
        self._num_replicas = num_replicas
        self._registry_name, self._registry_namespace = registry_name, registry_namespace
        self._registry = None
        self._admin_token = admin_token or os.environ.get(ADMIN_TOKEN_ENV) or None
        self._engine: dict | None = None
        self._unloaded: set[int] = set()
        self._merged_version = 0  # merge mode: the base weights now are this version's
        self._ctl = asyncio.Lock()  # one state change at a time: loads, unloads, weight updates
        # RoutingPolicy(**routing): prefix or round robin; None = Serve's own router (serve_default).
        self._policy = RoutingPolicy(**routing) if routing else None
        self._max_inflight = max(1, int(max_inflight_per_replica or DEFAULT_INFLIGHT_PER_REPLICA)) * num_replicas
        self._max_body = int(max_body_bytes)
        self._inflight = 0  # REST sequences + rollout calls now at the replicas
        self._counts = {"rejected_429": 0, "rejected_413": 0, "rejected_4xx": 0, "version_mismatches": 0}
        self._sha: dict[int, str | None] = {}  # version -> the registry's digest of it
        _add_scrub_roots(str(model_path).rstrip("/"), os.path.realpath(model_path))

    # ------------------------------------------------------------------ shared pieces

    def _reg(self):
        if self._registry is None:
            import ray

            self._registry = ray.get_actor(self._registry_name, namespace=self._registry_namespace)
        return self._registry

    async def _engine_info(self) -> dict:
        if self._engine is None:
            self._engine = await call_replica(self._replica, "engine_info")
        return self._engine

    async def live_versions(self) -> list[int]:
        """Versions new requests may use, oldest first."""
        live = await self._reg().live_versions.remote()
        return sorted(v for v in live if v not in self._unloaded)

    async def _key(self, token_ids: list[int], version: int) -> dict | None:
        """The prompt's route key under `version`, or None under Serve's built-in router."""
        if self._policy is None:
            return None
        bs = (await self._engine_info())["block_size"]
        if version > 0 and version != self._merged_version:
            return route_key(token_ids, bs, policy_name(version))
        return route_key(token_ids, bs, None, salt=f"merged-v{version}" if version else "")

    def _ticket(self, key: dict | None) -> RouteTicket | None:
        """One call's routing request (each call its own: the policy tracks calls one by one)."""
        return RouteTicket(self._policy, key) if self._policy is not None else None

    async def _broadcast(self, method: str, *args, timeout_s: float = BROADCAST_TIMEOUT_S
                         ) -> tuple[list, list[BaseException]]:
        try:
            results = await self._replica.broadcast(method, *args).results_async(
                timeout_s=timeout_s, return_exceptions=True)
        except (TimeoutError, asyncio.TimeoutError) as e:
            return [], [e]
        return ([r for r in results if not isinstance(r, BaseException)],
                [r for r in results if isinstance(r, BaseException)])

    async def registry_sha(self, version: int) -> str | None:
        """The registry's sha256 of a version (None for the original base model), cached."""
        if version <= 0:
            return None
        if version not in self._sha:
            try:
                self._sha[version] = (await self._reg().get.remote(version))["meta"].get("sha256")
            except Exception:
                return None  # trimmed from the registry: nothing to compare with
        return self._sha[version]

    # ------------------------------------------------------------------ driver API (handle methods)

    async def generate_group(self, prompt_token_ids: list[int], n: int, version: int | None = None,
                             sampling: dict | None = None, drop_if_expired: bool = False) -> list[dict]:
        """n samples of one prompt as n routed requests (so they share one replica's prefix cache);
        version None = the newest live version (base model when none is live). Each result names its
        version and the sha256 of the adapter that produced it. Counted against the in-flight limit,
        never refused by it (rollout workers pace themselves through the buffer). `drop_if_expired`
        (rollouts): the group fails with VersionExpiredError as soon as its version expires (`expire`)."""
        if n < 1:
            raise ValueError(f"generate_group: n must be >= 1, got {n}")
        ids = [int(t) for t in prompt_token_ids]
        info = await self._engine_info()
        if not ids or len(ids) >= info["max_model_len"]:
            raise ValueError(f"generate_group: prompt has {len(ids)} tokens; it must be 1..{info['max_model_len'] - 1}")
        try:
            v = resolve_version(version, await self.live_versions(), self._merged_version)
        except ModelNameError as e:
            raise ValueError(e.message) from None
        key = await self._key(ids, v)
        req = {"prompt_token_ids": ids, "version": v, "sampling": dict(sampling or {}),
               "drop_if_expired": bool(drop_if_expired)}
        self._inflight += n
        try:
            return list(await asyncio.gather(*[self._generate_retrying(req, key) for _ in range(n)]))
        finally:
            self._inflight -= n

    async def _generate_retrying(self, req: dict, key: dict | None) -> dict:
        """One sample; when its replica dies mid-call, the same request (same pinned version) goes
        through the handle again, a few times with backoff, within REPLICA_RETRY_DEADLINE_S. Errors the
        replica raised on purpose (4xx, bad version) are raised at once."""
        deadline = time.monotonic() + REPLICA_RETRY_DEADLINE_S
        for attempt in range(REPLICA_RETRY_ATTEMPTS):
            try:
                return await call_replica(self._replica, "generate", req, ticket=self._ticket(key))
            except Exception as e:
                left = deadline - time.monotonic()
                if not _replica_lost(e) or attempt == REPLICA_RETRY_ATTEMPTS - 1 or left <= 0:
                    raise
                self._counts["replica_retries"] = self._counts.get("replica_retries", 0) + 1
                logger.warning("generate: replica lost (%s); retry %d of %d under %s", _short(e), attempt + 1,
                               REPLICA_RETRY_ATTEMPTS - 1, served_name(req["version"]))
                await asyncio.sleep(min(REPLICA_RETRY_BACKOFF_S * 2 ** attempt, 4.0, left))
        raise AssertionError("unreachable")

    async def load_adapter(self, version: int) -> dict:
        """Load `policy-v{version}` (from the registry) on every replica. All or nothing: on any
        failure it is unloaded from the replicas that took it and the error raised; what was live
        stays live. A merged payload (merge mode) goes to `update_weights` instead: same protocol."""
        try:
            kind = payload_kind((await self._reg().get.remote(version))["meta"])
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
                                   f"{len(ok) + len(errors)} replicas: "
                                   f"{_short(errors[0]) if errors else 'none answered'}")
            # New base weights: old base-model blocks are stale on every replica, so new hashes.
            self._merged_version = version
            return {"version": version, "replicas": len(ok), "results": ok}

    async def expire(self, versions: list[int]) -> dict:
        """The registry trimmed these versions: every replica aborts their in-flight rollout requests
        (their samples could only be dropped as stale) so the adapter slots they hold free up at once.
        Best effort: a replica that misses it just lets them finish."""
        ok, errors = await self._broadcast("expire", list(versions))
        if errors:
            logger.warning("expire %s: %d replicas failed: %s", versions, len(errors), _short(errors[0]))
        return {"versions": list(versions), "aborted": sum(ok), "replicas": len(ok)}

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
        """Routing counters (affinity / spill / unmatched, predicted hit blocks), admission counters
        (in flight, limit, 429/413/4xx answers, version mismatches) and every replica's own stats,
        including vLLM's prefix-cache hits and queries."""
        ok, errors = await self._broadcast("stats")
        if self._policy is None:
            router = {"policy": "serve_default"}
        else:
            with self._policy.lock:
                router = self._policy.snapshot()
        hits = sum(s.get("prefix_cache_hits", 0) for s in ok)
        queries = sum(s.get("prefix_cache_queries", 0) for s in ok)
        return {"router": router, "replicas": sorted(ok, key=lambda s: str(s.get("replica_id"))),
                "replica_errors": [_short(e) for e in errors],
                "prefix_cache_hits": hits, "prefix_cache_queries": queries,
                "live_versions": await self.live_versions(), "merged_version": self._merged_version,
                "admission": {"inflight": self._inflight, "max_inflight": self._max_inflight, **self._counts}}

    async def health(self) -> tuple[bool, dict]:
        """Ready when every replica answers and holds every live version (the newest max_loras of
        them if more are live: a replica has no more slots, and loads an older one on demand; with
        the registry's default trim, live versions never outnumber the slots)."""
        try:
            live = await asyncio.wait_for(self.live_versions(), HEALTH_TIMEOUT_S)
            info = await asyncio.wait_for(self._engine_info(), HEALTH_TIMEOUT_S)
        except Exception as e:
            return False, {"status": "starting", "reason": f"registry or replicas not reachable ({type(e).__name__})",
                           "replicas_ready": 0, "replicas": self._num_replicas, "live": [], "missing_versions": {}}
        # Merged versions are base weights, not adapters: nothing to hold for them.
        need = {v for v in live[-info["max_loras"]:] if v > self._merged_version}
        ok, errors = await self._broadcast("stats", timeout_s=HEALTH_TIMEOUT_S)
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

    # ------------------------------------------------------------------ REST: OpenAI

    @api.get("/health")
    async def http_health(self):
        ready, body = await self.health()
        return _json(body, 200 if ready else 503)

    @api.get("/v1/models")
    async def http_models(self):
        info, live = await self._engine_info(), await self.live_versions()
        now = int(time.time())
        card = lambda mid, parent=None: {"id": mid, "object": "model", "created": now,  # noqa: E731
                                         "owned_by": "lora-grpo", "root": mid, "parent": parent,
                                         "max_model_len": info["max_model_len"]}
        base = base_id(info["model"])
        data = [card(base)] + ([card(BASE_NAME)] if base != BASE_NAME else [])
        data += [card(policy_name(v), base) for v in live]
        if live:
            data.append(card(POLICY_LATEST, base))
        return _json({"object": "list", "data": data})

    @api.post("/v1/completions")
    async def http_completions(self, request: Request):
        return await self._openai(request, "/v1/completions")

    @api.post("/v1/chat/completions")
    async def http_chat(self, request: Request):
        return await self._openai(request, "/v1/chat/completions")

    async def _openai(self, request: Request, path: str):
        if self._inflight >= self._max_inflight:  # before reading the body: overload costs nothing
            self._counts["rejected_429"] += 1
            return _overloaded(self._max_inflight).response()
        try:
            body = await self._body(request)
            token_ids, version, weight = await self._validate(body, chat=path.endswith("chat/completions"))
            key = await self._key(token_ids, version)
            if self._inflight + weight > self._max_inflight:
                self._counts["rejected_429"] += 1
                raise _overloaded(self._max_inflight)
        except APIError as e:
            if e.status == 413:
                self._counts["rejected_413"] += 1
            elif e.status != 429:
                self._counts["rejected_4xx"] += 1
            return e.response()
        self._inflight += weight
        release = _Once(lambda: setattr(self, "_inflight", self._inflight - weight))
        if body.get("stream"):
            try:
                return await self._stream(path, body, key, version, release)
            except BaseException:
                release()
                raise
        try:
            out = await call_replica(self._replica, "openai", path, body, ticket=self._ticket(key))
        except Exception as e:  # the replica died or refused the call
            return self._replica_failure(path, e).response()
        finally:
            release()
        err = out.get("error") if isinstance(out, dict) else None
        if isinstance(err, dict):  # vLLM's or the replica's ErrorResponse, with its own status code
            status = int(out.get("status_code") or err.get("code") or 400)
            if status < 500:
                self._counts["rejected_4xx"] += 1
            return _json(error_body(status, str(err.get("message", "")), openai_type(status), err.get("param")),
                         status)
        served = int(out.get("version", version))
        sha = out.pop("sha256", None)
        expected = await self.registry_sha(served)
        if served != version or (expected is not None and sha != expected):
            self._counts["version_mismatches"] += 1
            logger.error("served-version mismatch: asked %s, replica %s served %s (sha %s)",
                         version, out.get("replica_id"), served, sha)
        return _json(out, headers=self._version_headers(served, sha))

    def _version_headers(self, version: int, sha: str | None) -> dict:
        h = {"x-policy-version": str(version), "x-served-model": served_name(version)}
        if sha:
            h["x-adapter-sha256"] = sha
        return h

    def _replica_failure(self, path: str, e: BaseException) -> APIError:
        cause = getattr(e, "cause", None) or e
        status = getattr(cause, "status_code", None)
        if isinstance(status, int) and 400 <= status < 500:
            return APIError(status, _short(e).split(": ", 1)[-1], openai_type(status))
        logger.warning("replica failed %s: %s", path, _short(e))
        return APIError(503, "no replica could serve this request; retry", "server_error",
                        headers={"Retry-After": str(RETRY_AFTER_S)})

    async def _stream(self, path: str, body: dict, key: dict | None, version: int, release: _Once):
        """SSE relay. The first chunk is awaited before answering, so a request the replica refuses
        gets its 4xx status instead of a 200 stream holding an error. The replica call stays open
        until the relay ends (Serve's rule for a dispatched stream)."""
        call = ReplicaCall(self._replica, "openai_stream", self._ticket(key), stream=True)
        gen = None
        try:
            await call.open()
            gen = call.send(path, body)
            first = await gen.__anext__()
        except StopAsyncIteration:
            first = None
        except Exception as e:
            await self._end_stream(call, gen, release)
            return self._replica_failure(path, e).response()
        err = _sse_error(first)
        if err is not None:
            await self._end_stream(call, gen, release)
            status = int(err.get("status_code") or err["error"].get("code") or 400)
            e = err["error"]
            return _json(error_body(status, str(e.get("message", "")), openai_type(status), e.get("param")), status)
        # Headers leave before the replica's last chunk: the digest is the registry's for the
        # version this request was pinned to (every chunk's `model` names that version).
        try:
            headers = self._version_headers(version, await self.registry_sha(version))
        except BaseException:
            await self._end_stream(call, gen, release)
            raise
        return StreamingResponse(self._relay(first, gen, call, release), media_type="text/event-stream",
                                 headers=headers)

    @staticmethod
    async def _end_stream(call: ReplicaCall, gen, release: _Once, finished: bool = False) -> None:
        try:
            if gen is not None and not finished:
                gen.cancel()  # the client left (or the first chunk failed): stop generating
            await call.close()
        finally:
            release()

    async def _relay(self, first, gen, call: ReplicaCall, release: _Once):
        finished = False
        try:
            if first is not None:
                yield first
            async for chunk in gen:
                yield chunk
            finished = True
        except Exception as e:  # headers are sent: report in-band, the way vLLM does
            finished = True
            body = error_body(500, _short(e), "server_error")
            yield f"data: {json.dumps(body, ensure_ascii=True)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await self._end_stream(call, gen, release, finished)

    async def _body(self, request: Request) -> dict:
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise APIError(400, "Content-Length is not a number")
            if int(length) > self._max_body:
                raise APIError(413, f"request body is {int(length)} bytes; the limit is {self._max_body}")
        chunks: list[bytes] = []

        async def read():
            size = 0
            async for chunk in request.stream():  # chunked bodies have no Content-Length: count as they come
                size += len(chunk)
                if size > self._max_body:
                    raise APIError(413, f"request body is over the limit of {self._max_body} bytes")
                chunks.append(chunk)

        try:
            await asyncio.wait_for(read(), BODY_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise APIError(408, f"request body not received within {BODY_TIMEOUT_S:.0f}s") from None
        raw = b"".join(chunks)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise APIError(400, f"request body is not valid UTF-8 (byte {e.start})") from None
        try:
            body = json.loads(text, parse_constant=_reject_non_finite, parse_float=_finite_float)
        except json.JSONDecodeError as e:
            raise APIError(400, f"request body is not valid JSON: {e.msg} (line {e.lineno} column {e.colno})") from None
        except RecursionError:
            raise APIError(400, f"request body nests deeper than {MAX_DEPTH} levels") from None
        except ValueError as e:  # non-finite numbers, integers of more than 4300 digits
            raise APIError(400, f"request body is not valid JSON: {str(e)[:120]}") from None
        if not isinstance(body, dict):
            raise APIError(400, f"request body must be a JSON object, got {type(body).__name__}")
        _check_tree(body)
        return body

    async def _validate(self, body: dict, chat: bool) -> tuple[list[int], int, int]:
        """Check what the ingress can check before a replica sees it; pin the model to the exact
        version it runs under. Returns the (first) prompt's token ids, that version, and the number
        of sequences the request asks for (its weight against the in-flight limit)."""
        info = await self._engine_info()
        try:
            version = resolve_model(body.get("model"), await self.live_versions(), self._merged_version, info["model"])
        except ModelNameError as e:
            raise APIError(e.status, e.message, openai_type(e.status), "model") from None
        body["model"] = served_name(version)
        if not isinstance(body.get("stream", False), (bool, type(None))):
            raise APIError(400, f"stream must be a boolean, got {_show(body['stream'])}", param="stream")
        limit = info["max_model_len"]
        max_new = 0
        for field in ("max_tokens", "max_completion_tokens"):
            max_new = _int_field(body, field, 1, INT64) or max_new
        n = _int_field(body, "n", 1, self._max_inflight) or 1
        _int_field(body, "best_of", 1, self._max_inflight)
        prompts = self._chat_ids(body, limit) if chat else self._completion_ids(body.get("prompt"), limit)
        for ids in prompts:
            if len(ids) >= limit or len(ids) + max_new > limit:
                raise APIError(400, f"prompt is {len(ids)} tokens and max_tokens {max_new}; the context "
                                    f"is {limit} tokens (prompt + completion must fit)", param="prompt")
        weight = n * len(prompts)
        if weight > self._max_inflight:
            raise APIError(400, f"the request asks for {weight} sequences (n x prompts); this server admits at "
                                f"most {self._max_inflight} at once", param="n")
        return prompts[0], version, weight

    def _encode(self, text: str, limit: int) -> list[int]:
        if len(text) > self._max_token_chars * limit:  # cannot fit whatever it tokenizes to
            raise APIError(400, f"prompt is {len(text)} characters; it cannot fit the context of {limit} tokens",
                           param="prompt")
        return self._tok(text)["input_ids"]

    def _token_ids(self, ids: list, limit: int) -> list[int]:
        if len(ids) >= limit:
            raise APIError(400, f"prompt is {len(ids)} tokens; the context is {limit} tokens", param="prompt")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self._vocab for t in ids):
            raise APIError(400, f"prompt token ids must be integers in [0, {self._vocab})", param="prompt")
        return list(ids)

    def _completion_ids(self, prompt, limit: int) -> list[list[int]]:
        if isinstance(prompt, str) and prompt:
            return [self._encode(prompt, limit)]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return [self._token_ids(prompt, limit)]
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) and p for p in prompt):
            return [self._encode(p, limit) for p in prompt]
        if isinstance(prompt, list) and prompt and all(
                isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
            return [self._token_ids(p, limit) for p in prompt]
        raise APIError(400, "prompt must be a non-empty string, list of strings, or token id list(s)", param="prompt")

    def _chat_ids(self, body: dict, limit: int) -> list[list[int]]:
        msgs = _check_messages(body.get("messages"))
        chars = sum(len(m["content"]) for m in msgs if isinstance(m.get("content"), str))
        if chars > self._max_token_chars * limit:
            raise APIError(400, f"messages hold {chars} characters; they cannot fit the context of {limit} tokens",
                           param="messages")
        flags = {}
        for field, default in (("add_generation_prompt", True), ("continue_final_message", False)):
            v = body.get(field, default)
            if not isinstance(v, bool):
                raise APIError(400, f"{field} must be a boolean, got {_show(v)}", param=field)
            flags[field] = v
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict) or _RESERVED_TEMPLATE_KWARGS & set(kwargs):
            what = (", ".join(sorted(_RESERVED_TEMPLATE_KWARGS & set(kwargs))) if isinstance(kwargs, dict)
                    else "a " + type(kwargs).__name__)
            raise APIError(400, f"chat_template_kwargs must be an object of template variables (not {what})",
                           param="chat_template_kwargs")
        try:
            ids = self._tok.apply_chat_template(msgs, tokenize=True, return_dict=False, **flags, **kwargs)
        except Exception as e:
            raise APIError(400, f"messages could not be rendered with the chat template: {e}",
                           param="messages") from None
        return [list(ids)]

    # ------------------------------------------------------------------ REST: admin

    def _admin_check(self, request: Request) -> APIError | None:
        if not self._admin_token:
            return APIError(403, "admin disabled: set rollout.admin_token or LORA_GRPO_ADMIN_TOKEN", "permission_error")
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode("utf-8", "replace"), f"Bearer {self._admin_token}".encode()):
            return APIError(401, "admin routes need 'Authorization: Bearer <token>'", "authentication_error")
        return None

    async def _admin(self, request: Request, action):
        denied = self._admin_check(request)
        if denied:
            return denied.response()
        try:
            return _json(await action())
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

    # Last: whatever no route above matched. Under /admin a stranger learns nothing (401/403 first).
    @api.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
    async def http_unmatched(self, rest: str, request: Request):
        if request.url.path.startswith("/admin"):
            denied = self._admin_check(request)
            if denied:
                return denied.response()
        known = {"/v1/completions": "POST", "/v1/chat/completions": "POST", "/v1/models": "GET", "/health": "GET",
                 "/admin/pause": "POST", "/admin/resume": "POST", "/admin/stats": "GET"}
        if request.url.path in known:
            return APIError(405, f"{request.method} is not allowed here; use {known[request.url.path]}",
                            headers={"Allow": known[request.url.path]}).response()
        return APIError(404, "no such route", "not_found_error").response()
