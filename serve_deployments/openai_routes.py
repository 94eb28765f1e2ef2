"""The ingress's OpenAI-compatible REST routes: /v1/completions, /v1/chat/completions (JSON or SSE), /v1/models.

A completion request is admitted (the in-flight limit, before its body is even read: overload costs
nothing), read and hardened (openai_body.py), checked and tokenized (openai_requests.py), routed by its
prompt's route key, and forwarded to one replica's `openai` / `openai_stream`, where vLLM's own OpenAI
serving code runs; a 4xx the replica answers is passed through with its status.

Served-version proof: a completion's `model` is the exact version that produced it (`policy-vN` also
when `policy-latest` was asked, `base` for the base model) and the response carries `x-policy-version`
and `x-adapter-sha256` (the digest of the adapter the replica used); a replica that served another
version or digest than the registry's is counted (`version_mismatches`) and logged.

Streams: the first chunk is awaited before answering, so a request the replica refuses gets its 4xx
status instead of a 200 stream holding an error; after that, errors are reported in-band the way vLLM
does (`data: {"error": ...}` then `data: [DONE]`). The replica call stays open until the relay ends.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from common.faults import short_error
from common.names import BASE_NAME
from common.types import adapter_name, latest_name
from serve_deployments.admission import RETRY_AFTER_S, Admission
from serve_deployments.openai_api import CHAT, base_id, model_run, openai_type, served_name
from serve_deployments.openai_body import APIError, error_body, json_response, read_body
from serve_deployments.openai_requests import RequestChecker
from serve_deployments.replica_calls import ReplicaCall
from serve_deployments.replica_pool import ReplicaPool
from serve_deployments.served_versions import RunVersions, ServedVersions, UnknownRunError

logger = logging.getLogger("ray.serve")


class OpenAIRoutes:
    def __init__(self, pool: ReplicaPool, runs: RunVersions, admission: Admission,
                 checker: RequestChecker, max_body_bytes: int):
        self._pool = pool
        self._runs = RunVersions.of(runs)
        self._admission = admission
        self._checker = checker
        self._max_body = int(max_body_bytes)

    async def models(self) -> Response:
        """GET /v1/models: the base model (its directory's name, then `base`), every live version and
        `policy-latest` while one is live; on a fleet, every attached run's too (`RUN/policy-vN`)."""
        info = await self._pool.engine_info()
        live = await self._runs.live_all()
        now = int(time.time())

        def card(model_id: str, parent: str | None = None) -> dict:
            return {"id": model_id, "object": "model", "created": now, "owned_by": "lora-grpo", "root": model_id,
                    "parent": parent, "max_model_len": info["max_model_len"]}

        base = base_id(info["model"])
        data = [card(base)] + ([card(BASE_NAME)] if base != BASE_NAME else [])
        for run, versions in live.items():
            data += [card(adapter_name(v, run), base) for v in versions]
            if versions:
                data.append(card(latest_name(run), base))
        return json_response({"object": "list", "data": data})

    async def complete(self, request: Request, path: str) -> Response:
        """POST `path` (a completion or a chat completion): the replica's answer, or an error body."""
        if self._admission.full():  # before reading the body: overload costs nothing
            return self._admission.overloaded().response()
        try:
            body = await read_body(request, self._max_body)
            engine = await self._pool.engine_info()
            run = model_run(body.get("model"))
            try:
                versions = self._runs.get(run)
            except UnknownRunError as e:
                raise APIError(404, e.message, "not_found_error", "model") from None
            checked = self._checker.check(body, path == CHAT, live=await versions.live(),
                                          base_version=versions.merged_version, engine=engine, run=run)
            key = await self._pool.route_key(checked.prompt_ids, checked.version, versions.merged_version, run)
            if self._admission.full(checked.weight):
                raise self._admission.overloaded()
        except APIError as e:
            self._admission.rejected(e.status)
            return e.response()
        release = self._admission.take(checked.weight)
        if body.get("stream"):
            try:
                return await self._stream(path, body, key, checked.version, release, versions)
            except BaseException:
                release()
                raise
        try:
            out = await self._pool.call("openai", path, body, key=key)
        except Exception as e:  # the replica died or refused the call
            return self._replica_failure(path, e).response()
        finally:
            release()
        return await self._answer(out, checked.version, versions)

    async def _answer(self, out: dict, version: int, versions: ServedVersions) -> Response:
        err = out.get("error") if isinstance(out, dict) else None
        if isinstance(err, dict):  # vLLM's or the replica's ErrorResponse, with its own status code
            response = error_response(out)
            if response.status_code < 500:
                self._admission.counts["rejected_4xx"] += 1
            return response
        served = int(out.get("version", version))
        sha = out.pop("sha256", None)
        expected = await versions.sha(served)
        if served != version or (expected is not None and sha != expected):
            self._admission.counts["version_mismatches"] += 1
            logger.error("served-version mismatch: asked %s, replica %s served %s (sha %s)",
                         versions.name(version), out.get("replica_id"), served, sha)
        return json_response(out, headers=version_headers(served, sha, versions.run))

    @staticmethod
    def _replica_failure(path: str, e: BaseException) -> APIError:
        """A replica call that raised: its 4xx if the replica refused on purpose, else 503 (retry)."""
        cause = getattr(e, "cause", None) or e
        status = getattr(cause, "status_code", None)
        if isinstance(status, int) and 400 <= status < 500:
            return APIError(status, short_error(e).split(": ", 1)[-1], openai_type(status))
        logger.warning("replica failed %s: %s", path, short_error(e))
        return APIError(503, "no replica could serve this request; retry", "server_error",
                        headers={"Retry-After": str(RETRY_AFTER_S)})

    async def _stream(self, path: str, body: dict, key: dict | None, version: int,
                      release: Callable[[], None], versions: ServedVersions) -> Response:
        """SSE relay (module docstring)."""
        call = self._pool.stream("openai_stream", key)
        gen = None
        try:
            await call.open()
            gen = call.send(path, body)
            first = await gen.__anext__()
        except StopAsyncIteration:
            first = None
        except Exception as e:
            await _end_stream(call, gen, release)
            return self._replica_failure(path, e).response()
        refused = sse_error(first)
        if refused is not None:
            await _end_stream(call, gen, release)
            return error_response(refused)
        # Headers leave before the replica's last chunk: the digest is the registry's for the
        # version this request was pinned to (every chunk's `model` names that version).
        try:
            headers = version_headers(version, await versions.sha(version), versions.run)
        except BaseException:
            await _end_stream(call, gen, release)
            raise
        return StreamingResponse(_relay(first, gen, call, release), media_type="text/event-stream", headers=headers)


def version_headers(version: int, sha: str | None, run: str = "") -> dict:
    """The served-version proof headers of a response."""
    headers = {"x-policy-version": str(version), "x-served-model": served_name(version, run)}
    if sha:
        headers["x-adapter-sha256"] = sha
    return headers


def error_response(out: dict) -> Response:
    """A replica's error dict (`{"error": {...}, "status_code": N}`) as an error response of status N."""
    err = out["error"]
    status = int(out.get("status_code") or err.get("code") or 400)
    return json_response(error_body(status, str(err.get("message", "")), openai_type(status), err.get("param")),
                         status)


def sse_error(chunk) -> dict | None:
    """The error dict of an SSE `data: {"error": ...}` chunk, else None."""
    if not isinstance(chunk, str) or not chunk.startswith("data: {") or '"error"' not in chunk[:64]:
        return None
    try:
        obj = json.loads(chunk[len("data: "):])
    except ValueError:
        return None
    return obj if isinstance(obj, dict) and isinstance(obj.get("error"), dict) and "choices" not in obj else None


async def _end_stream(call: ReplicaCall, gen, release: Callable[[], None], finished: bool = False) -> None:
    try:
        if gen is not None and not finished:
            gen.cancel()  # the client left (or the first chunk failed): stop generating
        await call.close()
    finally:
        release()


async def _relay(first: str | None, gen, call: ReplicaCall, release: Callable[[], None]) -> AsyncIterator[str]:
    finished = False
    try:
        if first is not None:
            yield first
        async for chunk in gen:
            yield chunk
        finished = True
    except Exception as e:  # headers are sent: report in-band, the way vLLM does
        finished = True
        yield f"data: {json.dumps(error_body(500, short_error(e), 'server_error'), ensure_ascii=True)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        await _end_stream(call, gen, release, finished)
