"""Fakes for testing the ingress's parts apart from Serve, vLLM and the registry actor (the real ones
run in tests/test_router_serve.py, test_hostile_rest.py and test_replica_loss.py):

- `FakeRegistry`: the AdapterRegistry's `live_versions` / `get` as awaitable `.remote` calls;
- `FakeReplica` + `FakeReplicaHandle`: replicas behind a DeploymentHandle's `broadcast`, each holding
  a set of versions and failing the methods it is told to fail;
- `FakePool`: a ReplicaPool whose one-replica calls answer from a script (a result, an error, a stream);
- `make_request`: a real Starlette request over given body chunks.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from starlette.requests import Request

from serve_deployments.replica_pool import ReplicaPool
from serve_deployments.served_versions import ServedVersions

ENGINE = {"model": "/srv/models/tiny-model", "max_model_len": 64, "block_size": 4, "max_loras": 2}


class _Remote:
    def __init__(self, fn: Callable):
        self.remote = fn


class FakeRegistry:
    """The registry actor's `live_versions` and `get` (meta with sha256 and kind per version)."""

    def __init__(self, live: list[int] | None = None, meta: dict[int, dict] | None = None):
        self.live = list(live or [])
        self.meta = {v: {"sha256": f"sha-{v}", "kind": "adapter"} for v in self.live} | dict(meta or {})
        self.gone: BaseException | None = None
        self.live_versions = _Remote(self._live_versions)
        self.get = _Remote(self._get)

    async def _live_versions(self) -> list[int]:
        if self.gone is not None:  # what a call on a dead actor's handle raises
            raise self.gone
        return list(self.live)

    async def _get(self, version: int) -> dict:
        if version not in self.meta:
            raise KeyError(f"policy-v{version} is not held by the registry")
        return {"ref": [None], "meta": self.meta[version]}


def served_versions(live: list[int] | None = None, meta: dict[int, dict] | None = None) -> ServedVersions:
    registry = FakeRegistry(live, meta)
    return ServedVersions(lambda: registry)


class FakeReplica:
    """One replica's control methods: `fail[method] = error` makes that method raise it."""

    def __init__(self, replica_id: str, versions: set[int] | None = None):
        self.replica_id = replica_id
        self.versions = set(versions or ())
        self.fail: dict[str, BaseException] = {}
        self.calls: list[tuple] = []
        self.paused = False

    def _enter(self, method: str, *args) -> None:
        self.calls.append((method, *args))
        if method in self.fail:
            raise self.fail[method]

    async def load_adapter(self, version: int, run: str = "") -> dict:
        self._enter("load_adapter", version, *((run,) if run else ()))
        self.versions.add(version)
        return {"version": version, "replica_id": self.replica_id}

    async def unload_adapter(self, version: int, run: str = "") -> bool:
        self._enter("unload_adapter", version, *((run,) if run else ()))
        held = version in self.versions
        self.versions.discard(version)
        return held

    async def update_weights(self, version: int) -> dict:
        self._enter("update_weights", version)
        return {"version": version, "replica_id": self.replica_id}

    async def expire(self, versions: list[int]) -> int:
        self._enter("expire", versions)
        return len(versions)

    async def pause(self) -> None:
        self._enter("pause")
        self.paused = True

    async def resume(self) -> None:
        self._enter("resume")
        self.paused = False

    async def stats(self) -> dict:
        self._enter("stats")
        return {"replica_id": self.replica_id, "versions": sorted(self.versions), "prefix_cache_hits": 1,
                "prefix_cache_queries": 2}


class _BroadcastResponse:
    def __init__(self, calls: list[Callable]):
        self._calls = calls

    async def results_async(self, *, timeout_s: float | None = None, return_exceptions: bool = False) -> list:
        return list(await asyncio.wait_for(asyncio.gather(*[call() for call in self._calls],
                                                          return_exceptions=return_exceptions), timeout_s))


class FakeReplicaHandle:
    """The replica deployment's DeploymentHandle, for `broadcast` only."""

    def __init__(self, replicas: list[FakeReplica]):
        self.replicas = replicas

    def broadcast(self, method: str, *args) -> _BroadcastResponse:
        return _BroadcastResponse([lambda r=r: getattr(r, method)(*args) for r in self.replicas])


class FakeStream:
    """A streaming replica call: opened, sent, closed; its generator yields `chunks` then raises `error`."""

    def __init__(self, chunks: list[str], error: BaseException | None = None, open_error: BaseException | None = None):
        self.chunks, self.error, self.open_error = list(chunks), error, open_error
        self.opened = self.closed = self.cancelled = False

    async def open(self):
        if self.open_error is not None:
            raise self.open_error
        self.opened = True
        return self

    def send(self, path: str, body: dict):
        self.sent = (path, body)
        return self

    def __aiter__(self):
        return self

    async def __anext__(self) -> str:
        if self.chunks:
            return self.chunks.pop(0)
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True

    async def close(self) -> None:
        self.closed = True


class FakePool:
    """A ReplicaPool without Serve: `answers` is what successive one-replica calls return (an exception
    in it is raised), `stream_call` the streaming call handed out, `replicas` what a broadcast reaches
    (through the real ReplicaPool.broadcast); calls and route keys are recorded."""

    def __init__(self, answers: list | None = None, stream_call: FakeStream | None = None, engine: dict | None = None,
                 replicas: list[FakeReplica] | None = None):
        self.answers = list(answers or [])
        self.stream_call = stream_call
        self.engine = dict(engine or ENGINE)
        self.replicas = list(replicas or [])
        self.calls: list[tuple] = []
        self.weights: list[int] = []  # each one-replica call's weight (sequences) against the replica's load

    async def engine_info(self) -> dict:
        return self.engine

    async def route_key(self, token_ids: list[int], version: int, merged_version: int, run: str = "") -> dict:
        return {"ids": list(token_ids), "version": version}

    async def call(self, method: str, *args, key: dict | None = None, weight: int = 1):
        self.calls.append((method, args, key))
        self.weights.append(weight)
        await asyncio.sleep(0)
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def stream(self, method: str, key: dict | None) -> FakeStream:
        self.calls.append((method, (), key))
        return self.stream_call

    async def broadcast(self, method: str, *args, timeout_s: float = 10.0) -> tuple[list, list[BaseException]]:
        return await ReplicaPool(FakeReplicaHandle(self.replicas), None).broadcast(method, *args, timeout_s=timeout_s)

    def router_stats(self) -> dict:
        return {"policy": "serve_default"}


def make_request(chunks: list[bytes], headers: dict | None = None, path: str = "/v1/completions",
                 method: str = "POST", stall: bool = False) -> Request:
    """A Starlette request whose body arrives as `chunks` (then, with `stall`, never ends)."""
    messages = [{"type": "http.request", "body": c, "more_body": stall or i < len(chunks) - 1}
                for i, c in enumerate(chunks)]

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        if stall:
            await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": method, "path": path, "query_string": b"", "root_path": "",
             "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]}
    return Request(scope, receive)
