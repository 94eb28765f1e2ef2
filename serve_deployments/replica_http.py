"""REST straight to one replica: the OpenAI routes on the replica's own HTTP port (`rollout.replica_http_port`).

Why: through Serve, a REST request crosses two Python hops before the engine (Serve's HTTP proxy, then the
Ingress, each relaying every streamed message), and on a small host every CPU millisecond of theirs is taken
from the engine: BENCHMARKS.md section 12 measured 0.47-0.55x vLLM's own server on 2 cores, with ~3.5x its CPU
per request. vLLM's server is one process: HTTP, its serving classes, the engine. So is this front: uvicorn
runs on the replica's own event loop and calls the replica in-process, so a request costs what it costs in
vLLM's server plus our checks.

What stays the same as the routed endpoint: the same OpenAIRoutes (openai_routes.py) with the same body
hardening, request checks, model names (`policy-vN`, `policy-latest`, `base`, a fleet run's `RUN/...`),
served-version headers, admission (429 over `rollout.max_inflight_per_replica`) and a fleet's read token.
What it does not do: choose a replica (a client that talks to one replica's port gets that replica: no prefix
routing, no balancing), admin routes (adapter changes go through the ingress, which broadcasts them), and
stream batching (one message per token, as vLLM writes them: there is no hop to save).

The live versions come from the replica's short-lived cache of its registry (`RolloutReplica._live`): the
routed path asks the registry on every request, twice (ingress and replica), which on 2 cores cost as much as
a tenth of a request.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

from fastapi import FastAPI, Request

from serve_deployments.admission import Admission
from serve_deployments.openai_api import CHAT, COMPLETIONS
from serve_deployments.openai_body import error_body, install_error_handlers, json_response
from serve_deployments.openai_routes import OpenAIRoutes
from serve_deployments.served_versions import RunVersions

log = logging.getLogger("ray.serve")

PORT_TRIES = 64  # replicas of one node take the next free port after rollout.replica_http_port


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class _LocalRegistry:
    """The two registry calls ServedVersions makes, answered by the replica: live versions from its cache,
    a version's entry (for the sha256 header) from the run's registry."""

    def __init__(self, replica, run: str):
        self.live_versions = _Remote(lambda: replica._live(run, cached=True))
        self.get = _Remote(lambda version: replica._registry_call(run, "get", version))


class ReplicaRuns(RunVersions):
    """The runs this replica serves: the standalone run "" and, on a fleet, every run it holds a quota for
    (set when the run attached, dropped when it left); the base weights are the replica's own."""

    def __init__(self, replica):
        super().__init__(lambda run: _LocalRegistry(replica, run))
        self._replica = replica

    def _sync(self) -> None:
        quotas = set(self._replica._slots.quotas()) - {""}
        for run in set(self._runs) - {""} - quotas:
            self.drop(run)
        for run in quotas:
            self.add(run)
        self._runs[""].merged_version = self._replica._base_version

    def get(self, run: str = ""):
        self._sync()
        return super().get(run)

    def runs(self) -> list[str]:
        self._sync()
        return super().runs()


class LocalPool:
    """ReplicaPool's interface (replica_pool.py) for calls to this very replica: no routing, no Serve."""

    STREAMS = {"openai_stream": "_openai_events"}  # unbatched: no hop to batch for

    def __init__(self, replica):
        self._replica = replica

    async def engine_info(self) -> dict:
        return await self._replica.engine_info()

    async def route_key(self, *args, **kwargs) -> None:
        return None

    async def call(self, method: str, *args, key: dict | None = None, weight: int = 1):
        return await getattr(self._replica, method)(*args)

    def stream(self, method: str, key: dict | None) -> LocalStream:
        return LocalStream(getattr(self._replica, self.STREAMS.get(method, method)))


class LocalStream:
    """ReplicaCall's interface (replica_calls.py) over one of the replica's async generators."""

    def __init__(self, fn):
        self._fn = fn
        self._gen = None

    async def open(self) -> LocalStream:
        return self

    def send(self, *args) -> LocalStream:
        self._gen = self._fn(*args)
        return self

    def __aiter__(self) -> LocalStream:
        return self

    async def __anext__(self) -> str:
        return await self._gen.__anext__()

    def cancel(self) -> None:
        pass  # close() ends the generator: vLLM aborts the request as it unwinds

    async def close(self) -> None:
        if self._gen is not None:
            await self._gen.aclose()


def bind_socket(host: str, port: int, tries: int = PORT_TRIES) -> socket.socket:
    """A listening socket on `port` or the next free one (port 0: any); OSError naming the range if none."""
    last = None
    for p in [0] if port == 0 else range(port, min(port + tries, 65536)):
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, p))
        except OSError as e:
            sock.close()
            last = e
            continue
        sock.listen(2048)
        sock.setblocking(False)
        return sock
    raise OSError(f"rollout.replica_http_port: no free port in {port}..{port + tries - 1} on {host} ({last})")


def build_app(replica, tokenizer, max_inflight: int, max_body_bytes: int, access=None) -> FastAPI:
    """The replica's REST app: /v1/completions, /v1/chat/completions, /v1/models, /health."""
    from serve_deployments.openai_requests import RequestChecker

    app = FastAPI(title="lora-grpo replica", openapi_url=None, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    admission = Admission(max_inflight)
    front = OpenAIRoutes(LocalPool(replica), ReplicaRuns(replica), admission,
                        RequestChecker(tokenizer, admission.max_inflight), max_body_bytes)

    async def denied(request: Request):
        from serve_deployments.admin import bearer

        if access is None or await access.may_read(bearer(request)):
            return None
        return json_response(error_body(401, "reading this fleet needs 'Authorization: Bearer <read token>'",
                                        "authentication_error"), 401)

    @app.get("/health")
    async def health():
        try:
            await replica.check_health()
        except Exception as e:
            return json_response({"status": "engine failed", "reason": type(e).__name__}, 503)
        return json_response({"status": "ok", "replica_id": replica.replica_id})

    @app.get("/v1/models")
    async def models(request: Request):
        return await denied(request) or await front.models()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await denied(request) or await front.complete(request, COMPLETIONS)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await denied(request) or await front.complete(request, CHAT)

    app.state.admission = admission
    return app


class ReplicaHttp:
    """uvicorn serving `app` on this event loop (the replica's), on `sock`; `stop()` ends it."""

    def __init__(self, app: FastAPI, sock: socket.socket, public_host: str):
        import uvicorn

        self.port = sock.getsockname()[1]
        self.url = f"http://{public_host}:{self.port}/v1"
        self._server = uvicorn.Server(uvicorn.Config(app, lifespan="off", access_log=False, log_level="warning",
                                                     timeout_keep_alive=30))
        self._server.capture_signals = contextlib.nullcontext  # the process and its signals are Serve's
        self._sock = sock
        self._task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        try:
            await self._server.serve(sockets=[self._sock])
        except Exception:
            log.exception("replica REST server on %s stopped", self.url)

    def stop(self) -> None:
        self._server.should_exit = True
