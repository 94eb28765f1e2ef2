"""The replica's OpenAI path: /v1/completions and /v1/chat/completions on one exact version.

A request's model name (`base`, `policy-vN`, `RUN/policy-vN`, the aliases of openai_api.py) is resolved
against its run's live versions, validated with vLLM's request models, pinned to that exact version (the
body then names it exactly) and served by vLLM's serving classes while the request holds the version's
slot. Results carry what was served (model, version, run, sha256, replica_id); errors come back as OpenAI
error dicts with the status code the ingress answers with.

The serving handlers are injected (anything with `lora_requests`, async `create_completion`,
`create_chat_completion`): vllm_engine.VllmServing on a replica, fakes in a unit test.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable

from common.names import BASE_NAME
from common.types import adapter_name
from serve_deployments.engine_weights import ReplicaError
from serve_deployments.openai_api import (
    COMPLETIONS,
    ROUTES,
    ModelNameError,
    error_body,
    model_run,
    resolve_model,
    served_name,
)
from serve_deployments.replica_adapters import ReplicaAdapters

log = logging.getLogger("ray.serve")


def error_dict(message: str, status_code: int) -> dict:
    """OpenAI's error body plus the status code the ingress answers with."""
    return {**error_body(status_code, message), "status_code": status_code}


def vllm_error(e: Exception) -> dict:
    """An exception from vLLM's request handling as the error dict of its status code."""
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    r = create_error_response(e)
    if r.error.code >= 500:
        log.exception("openai request failed")
    return error_dict(r.error.message, r.error.code)


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


class OpenAIPath:
    def __init__(self, serving, adapters: ReplicaAdapters, model: str, replica_id: str,
                 check_seed: Callable[[object], None], stream_interval_s: float = 0.0):
        self.serving, self.adapters, self.model, self.replica_id = serving, adapters, model, replica_id
        self._check_seed = check_seed
        self.stream_interval_s = stream_interval_s

    async def resolve(self, path: str, body: dict):
        """Validate with vLLM's request models; returns (run, version, request). `RUN/policy-vN` names a fleet
        run's version, resolved against that run's live versions."""
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        if path not in ROUTES:
            raise ReplicaError(f"unknown route {path}; this replica serves {', '.join(ROUTES)}", 404)
        self._check_seed(body.get("seed"))
        run = model_run(body.get("model"))
        live, base = self.adapters.registries.live, self.adapters.base_version
        try:  # the ingress sends exact names; aliases mean what they mean there (openai_api)
            try:
                version = resolve_model(body.get("model"), await live(run, cached=True), base, self.model, run)
            except ModelNameError:  # perhaps newer than the cache: ask the registry itself
                version = resolve_model(body.get("model"), await live(run), base, self.model, run)
        except ModelNameError as e:
            raise ReplicaError(e.message, e.status) from None
        on_base = not run and version == base
        body = dict(body, model=BASE_NAME if on_base else adapter_name(version, run))
        try:
            request = (CompletionRequest if path == COMPLETIONS else ChatCompletionRequest).model_validate(body)
        except ValidationError as e:
            raise ReplicaError(str(e), 400) from e
        return run, version, request

    async def openai(self, path: str, body: dict) -> dict:
        """replica.py's `openai`."""
        try:
            run, version, request = await self.resolve(path, dict(body, stream=False))
            async with self.adapters.hold(version, run):
                result = await self._create(path, request)
        except ReplicaError as e:
            return error_dict(str(e), e.status_code)
        except Exception as e:  # vLLM's own request errors (validation etc.) -> its status codes
            return vllm_error(e)
        return self.result(result, version, run)

    async def _create(self, path: str, request):
        """The serving handler for the route: a response, an ErrorResponse, or a stream of SSE lines."""
        if path == COMPLETIONS:
            return await self.serving.create_completion(request)
        return await self.serving.create_chat_completion(request)

    def result(self, result, version: int, run: str = "") -> dict:
        """A serving handler's response as the dict the ingress answers with."""
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        if isinstance(result, ErrorResponse):
            return error_dict(result.error.message, result.error.code)
        out = result.model_dump(mode="json", exclude_none=True)
        out["model"] = served_name(version, run)  # never a server path, never an alias
        out["version"] = version
        out["run"] = run
        out["sha256"] = self.adapters.served_sha(version, run)  # the ingress moves it to the x-adapter-sha256 header
        out["replica_id"] = self.replica_id
        return out

    async def stream(self, path: str, body: dict):
        """replica.py's `openai_stream`."""
        from serve_deployments.stream_batch import batched

        async for text in batched(self.events(path, body), self.stream_interval_s):
            yield text

    async def events(self, path: str, body: dict):
        """The SSE lines of one streamed request, one per message as vLLM writes them."""
        try:
            run, version, request = await self.resolve(path, dict(body, stream=True))
        except ReplicaError as e:
            yield _sse(error_dict(str(e), e.status_code))
            return
        try:
            async with self.adapters.hold(version, run):
                result = await self._create(path, request)
                if not hasattr(result, "__aiter__"):
                    yield _sse(self.result(result, version, run))
                    return
                async for chunk in result:
                    yield chunk
        except ReplicaError as e:
            yield _sse(error_dict(str(e), e.status_code))
        except Exception as e:
            yield _sse(vllm_error(e))
