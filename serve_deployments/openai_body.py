"""JSON in and out of the REST front: request bodies read and hardened, error bodies scrubbed.

Hostile bodies get an OpenAI-style `{"error": {message, type, param, code}}` (APIError), never a 5xx:
- over `max_bytes` -> 413 before parsing (by Content-Length, or counted as a chunked body arrives);
  a body trickling in slower than BODY_TIMEOUT_S -> 408;
- not strict UTF-8 JSON, NaN/Infinity or floats out of range, lone UTF-16 surrogates (in keys too),
  nesting deeper than MAX_DEPTH, integers outside int64, anything but an object at the top -> 400.

No server path leaves: every error message passes `scrub`, which turns the model directory (registered
with `add_scrub_roots`) into its public id and any other absolute path into `<path>`.
No Ray, no Serve: unit-tested with Starlette requests (tests/test_openai_front.py).
"""
from __future__ import annotations

import asyncio
import json
import math
import re

from fastapi import Request
from fastapi.responses import Response

from common.names import BASE_NAME
from serve_deployments import openai_api

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
BODY_TIMEOUT_S = 30.0  # a body that trickles in slower than this is answered 408, not waited on forever
MAX_DEPTH = 32  # JSON nesting; chat messages with tool schemas need < 10
INT64 = 2 ** 63 - 1  # vLLM turns sampling integers into int64 tensors; larger ones overflow in the engine
# Absolute paths with 2+ components (not our own routes): scrubbed from every message that leaves.
_ABS_PATH = re.compile(r"(?<![\w.:/])/(?!v1/|admin/)[\w.\-~]+(?:/[\w.\-~]*)+")
_SCRUB_ROOTS: list[str] = []  # the model directory and its real path, longest first


def add_scrub_roots(*roots: str) -> None:
    """Paths that `scrub` replaces by the base model's public id (the ingress adds its model directory)."""
    for root in roots:
        if len(root) > 1 and root not in _SCRUB_ROOTS:
            _SCRUB_ROOTS.append(root)
    _SCRUB_ROOTS.sort(key=len, reverse=True)


def scrub(message: str) -> str:
    """No server path leaves this process: the model dir becomes its public id, other paths <path>."""
    message = str(message)
    for root in _SCRUB_ROOTS:
        message = message.replace(root, BASE_NAME)
    return _ABS_PATH.sub("<path>", message)


def json_response(body, status: int = 200, headers: dict | None = None) -> Response:
    """JSON with non-ASCII escaped: a response can never fail to encode (no 500 after the fact)."""
    return Response(json.dumps(body, ensure_ascii=True), status_code=status, headers=headers,
                    media_type="application/json")


def error_body(status: int, message: str, type_: str | None = None, param: str | None = None) -> dict:
    """openai_api.error_body with the message scrubbed of server paths (every error leaves through here)."""
    return openai_api.error_body(status, scrub(message), type_, param)


class APIError(Exception):
    """A client error: becomes an OpenAI-style error body with this status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers

    def response(self) -> Response:
        return json_response(error_body(self.status, self.message, self.type, self.param), self.status,
                             self.headers)


async def read_body(request: Request, max_bytes: int, timeout_s: float = BODY_TIMEOUT_S) -> dict:
    """The request's JSON object, hardened (module docstring); raises APIError."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise APIError(400, "Content-Length is not a number")
        if int(length) > max_bytes:
            raise APIError(413, f"request body is {int(length)} bytes; the limit is {max_bytes}")
    chunks: list[bytes] = []

    async def read():
        size = 0
        async for chunk in request.stream():  # chunked bodies have no Content-Length: count as they come
            size += len(chunk)
            if size > max_bytes:
                raise APIError(413, f"request body is over the limit of {max_bytes} bytes")
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise APIError(408, f"request body not received within {timeout_s:.0f}s") from None
    return parse_body(b"".join(chunks))


def parse_body(raw: bytes) -> dict:
    """A body's bytes as a JSON object, hardened (module docstring); raises APIError."""
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


def _reject_non_finite(text: str):
    raise ValueError(f"{text} is not valid JSON (numbers must be finite)")


def _finite_float(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"number {text[:32]} is out of range")
    return number


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
            for key, value in node.items():
                _check_str(key)
                stack.append((value, depth + 1))
        elif isinstance(node, list):
            stack.extend((value, depth + 1) for value in node)


def _check_str(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "request body contains an invalid string (a lone UTF-16 surrogate such as \\ud800)"
                       ) from None


def install_error_handlers(app) -> None:
    """OpenAI-style error bodies for what FastAPI itself refuses (unknown routes, methods, unparsable
    requests), a 503 while the registry is gone, and a scrubbed 500 for a bug: the ingress's app and a
    replica's own (replica_http.py)."""
    import logging

    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from serve_deployments.served_versions import RegistryGoneError

    logger = logging.getLogger("ray.serve")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return json_response(error_body(exc.status_code, str(exc.detail), kind), exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return json_response(error_body(400, "invalid request"), 400)

    @app.exception_handler(RegistryGoneError)
    async def _registry_gone(request: Request, exc: RegistryGoneError):
        logger.warning("%s: %s", request.url.path, exc)
        return json_response(error_body(503, scrub(str(exc)), "server_error"), 503, {"Retry-After": "5"})

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return json_response(error_body(500, "internal error", "server_error"), 500)
