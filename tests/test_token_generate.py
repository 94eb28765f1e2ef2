"""POST /inference/v1/generate (serve_deployments/token_generate.py), the token-in/token-out route verifiers'
renderer client trains through: the real client (`renderers.client.generate`, as verifiers' TrainClient calls
it) renders the chat with the tiny model's tokenizer and posts to the real route over ASGI; behind the route the
real RolloutGroups pins the version, and a scripted replica pool stands in for the engines (the route's own
logic is what is tested here; the rollout path to real engines is tests/test_multiturn.py's)."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi import FastAPI, Request

from serve_deployments.admission import Admission
from serve_deployments.rollout_groups import RolloutGroups
from serve_deployments.token_generate import TokenGenerate
from tests._ingress_fakes import FakePool, served_versions


def sample(version: int) -> dict:
    return {"version": version, "token_ids": [70, 71, 2], "logprobs": [-0.1, -0.2, -0.3], "sha256": f"sha-{version}",
            "finish_reason": "stop", "replica_id": "r0"}


def service(answers: list, live=(3, 4)):
    pool = FakePool(answers, engine={"model": "/srv/models/tiny-model", "max_model_len": 256, "block_size": 4,
                                     "max_loras": 2})
    versions = served_versions(list(live))
    routes = TokenGenerate(pool, versions, RolloutGroups(pool, versions, Admission(16)), 1 << 20)
    app = FastAPI()

    @app.post("/inference/v1/generate")
    async def generate(request: Request):
        return await routes.generate(request)

    return app, pool


def post(app, body) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post("/inference/v1/generate", content=json.dumps(body))

    return asyncio.run(go())


def test_verifiers_renderer_client_gets_the_engine_ids_and_logprobs(tiny_model_dir):
    pytest.importorskip("renderers")
    from openai import AsyncOpenAI
    from renderers import create_renderer
    from renderers.base import load_tokenizer
    from renderers.client import generate

    app, pool = service([[sample(4)]])
    renderer = create_renderer(load_tokenizer(str(tiny_model_dir)), None)
    messages = [{"role": "user", "content": "Say the letter K, not Q or Z."}]

    async def go():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
        client = AsyncOpenAI(base_url="http://t/v1", api_key="unused", http_client=http)
        return await generate(client=client, renderer=renderer, messages=messages, model="policy-v3",
                              sampling_params={"max_tokens": 3, "temperature": 1.0})

    out = asyncio.run(go())
    assert out["completion_ids"] == [70, 71, 2] and out["completion_logprobs"] == [-0.1, -0.2, -0.3]
    assert out["finish_reason"] == "stop"
    [(method, (req, n), _)] = pool.calls
    # the engine got exactly the ids the client rendered, under the version the model named
    assert method == "generate_n" and n == 1 and req["version"] == 3
    rendered = renderer.render(messages, add_generation_prompt=True).token_ids
    assert req["prompt_token_ids"] == out["prompt_ids"] == rendered
    assert req["sampling"]["max_tokens"] == 3 and req["sampling"]["logprobs"] is True


def test_policy_latest_is_pinned_and_the_answer_names_its_version():
    app, pool = service([[sample(4)]])
    r = post(app, {"model": "policy-latest", "token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 3}})
    assert r.status_code == 200 and r.headers["x-policy-version"] == "4" and r.headers["x-adapter-sha256"] == "sha-4"
    body = r.json()
    assert body["model"] == "policy-v4" and body["prompt_token_ids"] == [5, 6, 7]
    assert body["choices"][0]["logprobs"]["content"][1] == {"token": "token_id:71", "logprob": -0.2}


@pytest.mark.parametrize("body, status, words", [
    ({"model": "policy-v3", "token_ids": []}, 400, "token_ids must be a non-empty list"),
    ({"model": "policy-v3", "token_ids": [1, "2"]}, 400, "token_ids must be"),
    ({"model": "policy-v9", "token_ids": [1]}, 404, "'policy-v9' does not exist"),
    ({"model": "policy-v3", "token_ids": [1], "sampling_params": {"best_of": 2}}, 400, "unsupported best_of"),
    ({"model": "policy-v3", "token_ids": [1] * 300}, 400, "must be 1..255"),
])
def test_bad_requests_get_a_4xx_naming_the_problem(body, status, words):
    app, pool = service([])
    r = post(app, body)
    assert r.status_code == status and words in r.json()["error"]["message"] and pool.calls == []
