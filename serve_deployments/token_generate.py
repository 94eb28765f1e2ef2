"""POST /inference/v1/generate: vLLM's token-in/token-out route, the one verifiers' renderer client (and
prime-rl's) trains through. The client renders the chat to token ids itself; this route samples one
completion of exactly those ids and answers exactly the sampled ids with their behaviour logprobs:

    {"model": "policy-vN", "token_ids": [...], "sampling_params": {"max_tokens", "temperature", ...}}
 -> {"model": "policy-vN", "prompt_token_ids": [...], "choices": [{"index": 0, "token_ids": [...],
     "logprobs": {"content": [{"token": "token_id:<id>", "logprob": x}, ...]}, "finish_reason": ...}]}

`model` names one exact version as on the OpenAI routes (`policy-vN`, `policy-latest` = the newest live one
pinned now, `base`), and the sample runs under that version through the rollout path
(rollout_groups.RolloutGroups.generate_group: routed by prefix, retried on a lost replica); the response
carries the served-version headers. Only the sampling parameters the rollout path passes to vLLM are taken.
"""
from __future__ import annotations

import uuid

from fastapi import Request
from fastapi.responses import Response

from serve_deployments.openai_api import ModelNameError, model_run, openai_type, resolve_model, served_name
from serve_deployments.openai_body import APIError, json_response, read_body
from serve_deployments.openai_routes import version_headers
from serve_deployments.replica_rollout import SAMPLING_EXTRA
from serve_deployments.served_versions import RunVersions, UnknownRunError

SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "seed", *SAMPLING_EXTRA)
# Keys the renderer client always sends that change nothing here: logprobs are always returned (one per
# sampled token) and token ids are never detokenized into the answer.
IGNORED_KEYS = ("logprobs", "skip_special_tokens", "spaces_between_special_tokens", "n")


class TokenGenerate:
    def __init__(self, pool, runs: RunVersions, rollouts, max_body_bytes: int):
        self._pool = pool
        self._runs = RunVersions.of(runs)
        self._rollouts = rollouts  # rollout_groups.RolloutGroups
        self._max_body = int(max_body_bytes)

    async def generate(self, request: Request) -> Response:
        try:
            body = await read_body(request, self._max_body)
            ids, sampling = _token_ids(body), _sampling(body)
            run = model_run(body.get("model"))
            try:
                versions = self._runs.get(run)
            except UnknownRunError as e:
                raise APIError(404, e.message, "not_found_error", "model") from None
            engine = await self._pool.engine_info()
            try:
                version = resolve_model(body.get("model"), await versions.live(), versions.merged_version,
                                        engine["model"], run)
            except ModelNameError as e:
                raise APIError(e.status, e.message, openai_type(e.status), "model") from None
            try:
                out = (await self._rollouts.generate_group(ids, 1, version, sampling, run=run))[0]
            except ValueError as e:  # a prompt too long for the engine, a version gone meanwhile
                raise APIError(400, str(e), param="token_ids") from None
        except APIError as e:
            return e.response()
        served = int(out["version"])
        tokens, logprobs = list(out["token_ids"]), list(out["logprobs"])
        answer = {"id": f"gen-{uuid.uuid4().hex}", "model": served_name(served, run), "prompt_token_ids": ids,
                  "choices": [{"index": 0, "token_ids": tokens, "finish_reason": out.get("finish_reason"),
                               "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": float(lp)}
                                                        for t, lp in zip(tokens, logprobs)]}}],
                  "usage": {"prompt_tokens": len(ids), "completion_tokens": len(tokens),
                            "total_tokens": len(ids) + len(tokens)}}
        return json_response(answer, headers=version_headers(served, out.get("sha256"), run))


def _token_ids(body: dict) -> list[int]:
    ids = body.get("token_ids")
    if not (isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in ids)):
        raise APIError(400, "token_ids must be a non-empty list of token ids (non-negative integers)",
                       param="token_ids")
    return ids


def _sampling(body: dict) -> dict:
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise APIError(400, "sampling_params must be an object", param="sampling_params")
    unknown = sorted(set(params) - set(SAMPLING_KEYS) - set(IGNORED_KEYS))
    if unknown:
        raise APIError(400, f"sampling_params: unsupported {', '.join(unknown)} (supported: "
                            f"{', '.join(SAMPLING_KEYS)})", param="sampling_params")
    out = {k: params[k] for k in SAMPLING_KEYS if k in params and params[k] is not None}
    return dict(out, logprobs=True)
