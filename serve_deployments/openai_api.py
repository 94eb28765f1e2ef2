"""The OpenAI surface's rules that the ingress and the replica share: what a model name means, the error
body, and the routes. One definition each; both sides import this module (no Ray, no vLLM: unit-tested).

Model names (`model` of a REST request; the ingress pins it to the exact version before a replica sees it):
- the base model: `base`, the model directory's name (the id GET /v1/models lists first), or no model ->
  the version the engine's base weights are: 0, or N after merge mode made the merged weights of
  policy-vN the base weights;
- `policy-vN` -> N, if N is live;
- `policy-latest` -> the newest live version; 404 while none is live;
- on a fleet, `RUN/policy-vN` and `RUN/policy-latest` mean the same for run RUN's versions (`model_run`
  picks the run, whose live versions the caller then passes);
- not a string, or not shaped like an id (paths, traversal, control characters, over 128 characters)
  -> 400, and the name is never echoed; any other id -> 404 naming what is served.
"Live" is the caller's list of versions new requests may use, oldest first. The ingress passes the
registry's live versions minus those an operator unloaded; a replica called directly (tests, benchmarks)
passes the registry's live versions (it does not know about operator unloads, which only the ingress
applies). So `policy-latest` means the same version on both sides: the newest live one, never merely the
newest adapter some replica happens to hold.
"""
from __future__ import annotations

import os
import re

from common.names import BASE_NAME
from common.types import POLICY_LATEST, RUN_NAME, adapter_name, latest_name, parse_policy_name, split_run

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
ROUTES = (COMPLETIONS, CHAT)  # the OpenAI routes a replica serves (POST)

MODEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")


class ModelNameError(ValueError):
    """A model name that names nothing served: the status to answer and a message safe to show."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def base_id(model_path: str) -> str:
    """The base model's public id: its directory's name (`base` is accepted too)."""
    return os.path.basename(str(model_path).rstrip("/")) or BASE_NAME


def served_name(version: int, run: str = "") -> str:
    """The public id of what served a request: `policy-vN` / `RUN/policy-vN` (also when a `latest` alias was
    asked), or `base`."""
    return adapter_name(version, run) if version > 0 else BASE_NAME


def model_run(model) -> str:
    """The run a REST `model` names: `RUN` of `RUN/...` when RUN is shaped like a run name, else "" (the
    standalone run, or a fleet's base model; resolve_model refuses what is not an id)."""
    if not isinstance(model, str) or "/" not in model:
        return ""
    run, _ = split_run(model)
    return run if RUN_NAME.fullmatch(run) else ""


def resolve_model(model, live: list[int], base_version: int, model_path: str, run: str = "") -> int:
    """The exact version a REST `model` names (module docstring), among run `run`'s `live` versions; raises
    ModelNameError."""
    if run:
        if not isinstance(model, str) or model_run(model) != run:
            raise ModelNameError(400, f"model must name run {run}'s versions")
        rest = split_run(model)[1]
        if rest == POLICY_LATEST:
            if not live:
                raise ModelNameError(404, f"{latest_name(run)}: no policy version of run {run} is live yet")
            return live[-1]
        v = parse_policy_name(rest) if MODEL_ID.fullmatch(rest) else None
        if v is None or v not in live:
            raise ModelNameError(404, f"model {model!r} does not exist; run {run} serves: "
                                      f"{', '.join(served_names(live, model_path, run)) or 'nothing yet'}")
        return v
    if model in (None, "", BASE_NAME, base_id(model_path)):
        return base_version
    if not isinstance(model, str):
        raise ModelNameError(400, f"model must be a string, got {type(model).__name__}")
    if not MODEL_ID.fullmatch(model):  # paths, traversal, control characters: never echoed
        raise ModelNameError(400, "model is not a model id (ids are like base, policy-v3, policy-latest); see "
                                  "GET /v1/models")
    if model == POLICY_LATEST:
        if not live:
            raise ModelNameError(404, f"{POLICY_LATEST}: no policy version is live yet")
        return live[-1]
    v = parse_policy_name(model)
    if v is None or v not in live:  # policy-v0 too: the base model has no policy name
        raise ModelNameError(404, f"model {model!r} does not exist; serving: "
                                  f"{', '.join(served_names(live, model_path))}")
    return v


def resolve_version(version: int | None, live: list[int], base_version: int, run: str = "") -> int:
    """The exact version a handle call's `version` names: None = the newest live version, the base weights'
    version while none is live; else it must be live or the base weights' version. Raises ModelNameError.
    A fleet run's version 0 is the fleet's base model, as for a standalone run before its first publish."""
    if version is None:
        return live[-1] if live else base_version
    if version == base_version or version in live:
        return version
    raise ModelNameError(404, f"{served_name(version, run)} is not live "
                              f"(live: {[adapter_name(v, run) for v in live]})")


def served_names(live: list[int], model_path: str, run: str = "") -> list[str]:
    """Every name a request may use, in the order GET /v1/models lists them (a fleet run: its own only)."""
    own = [adapter_name(v, run) for v in live] + ([latest_name(run)] if live else [])
    if run:
        return own
    return list(dict.fromkeys([base_id(model_path), BASE_NAME] + own))


def openai_type(status: int) -> str:
    """OpenAI's error type for a status (vLLM's own names, e.g. BadRequestError, are not OpenAI's)."""
    return {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
            429: "rate_limit_error"}.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str, type_: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error body: `{"error": {message, type, param, code}}` (type from the status by default)."""
    return {"error": {"message": str(message), "type": type_ or openai_type(status), "param": param,
                      "code": status}}
