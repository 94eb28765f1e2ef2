"""The ingress's OpenAI REST front, tested apart from Serve and vLLM: bodies read and hardened
(openai_body.py) from real Starlette requests, requests checked and tokenized (openai_requests.py) with
the embedded tiny model's real tokenizer, and the front's flow (openai_routes.py) over a fake replica
pool and a fake registry (tests/_ingress_fakes.py). The same paths against real replicas:
tests/test_hostile_rest.py and tests/test_router_serve.py."""
from __future__ import annotations

import asyncio
import json

import pytest
import ray.exceptions as rex
from fastapi import Request

from serve_deployments.admission import Admission
from serve_deployments.engine_weights import ReplicaError
from serve_deployments.openai_api import CHAT, COMPLETIONS
from serve_deployments.openai_body import (
    INT64,
    MAX_DEPTH,
    APIError,
    add_scrub_roots,
    error_body,
    parse_body,
    read_body,
)
from serve_deployments.openai_requests import RequestChecker
from serve_deployments.openai_routes import OpenAIRoutes
from tests._ingress_fakes import ENGINE, FakePool, FakeStream, make_request, served_versions


@pytest.fixture(scope="module")
def tokenizer():
    from app.tiny_model import build_tokenizer

    return build_tokenizer()


def status_of(fn, *args, **kwargs) -> tuple[int, str]:
    with pytest.raises(APIError) as e:
        fn(*args, **kwargs)
    return e.value.status, e.value.message


# ---------------------------------------------------------------- JSON hardening

@pytest.mark.parametrize("raw,words", [
    (b"{not json", "not valid JSON"),
    (b"", "not valid JSON"),
    (b"\xff\xfe{}", "UTF-8"),
    (b'{"prompt": "\xc3\x28"}', "UTF-8"),
    (b'\xef\xbb\xbf{"prompt": "a"}', "not valid JSON"),
    (b"[1, 2]", "JSON object, got list"),
    (b"null", "JSON object, got NoneType"),
    (b'"text"', "JSON object, got str"),
    (b'{"temperature": NaN}', "finite"),
    (b'{"top_p": -Infinity}', "finite"),
    (b'{"temperature": 1e999}', "out of range"),
    (b"[" * 100_000 + b"]" * 100_000, "nests deeper"),
    (b'{"x": ' + b"[" * (MAX_DEPTH + 8) + b"]" * (MAX_DEPTH + 8) + b"}", "nests deeper"),
    (b'{"prompt": "\\ud800abc"}', "surrogate"),
    (b'{"\\udfff": 1}', "surrogate"),
    (b'{"stop": ["ok", {"deep": "\\udc00"}]}', "surrogate"),
    (json.dumps({"top_k": INT64 + 1}).encode(), "64-bit"),
    (json.dumps({"seed": -INT64 - 2}).encode(), "64-bit"),
    (b'{"max_tokens": ' + b"9" * 5000 + b"}", "not valid JSON"),
])
def test_hostile_bodies_are_400(raw, words):
    status, message = status_of(parse_body, raw)
    assert status == 400 and words in message, message


def test_good_body_parses_with_int64_bounds():
    body = {"prompt": "héllo ☃", "top_k": INT64, "seed": -INT64 - 1, "x": [[[]]], "t": 0.5, "b": True}
    assert parse_body(json.dumps(body).encode()) == body


def test_read_body_limits():
    async def go():
        # Content-Length over the limit: refused before a byte is read (the body never ends).
        req = make_request([b"{}"], {"content-length": "2048"}, stall=True)
        with pytest.raises(APIError) as e:
            await read_body(req, 1024)
        assert e.value.status == 413 and "2048 bytes" in e.value.message
        # Chunked (no Content-Length): counted as it arrives.
        with pytest.raises(APIError) as e:
            await read_body(make_request([b'{"prompt": "', b"a" * 600, b"b" * 600, b'"}']), 1024)
        assert e.value.status == 413
        with pytest.raises(APIError) as e:
            await read_body(make_request([b"{}"], {"content-length": "12x"}), 1024)
        assert e.value.status == 400
        with pytest.raises(APIError) as e:  # a body that trickles in and stops
            await read_body(make_request([b'{"prompt"'], stall=True), 1024, timeout_s=0.2)
        assert e.value.status == 408
        assert await read_body(make_request([b'{"prompt": ', b'"ab"}']), 1024) == {"prompt": "ab"}

    asyncio.run(go())


def test_error_messages_name_no_server_path():
    add_scrub_roots("/srv/models/tiny-model")
    msg = error_body(400, "/srv/models/tiny-model/config.json is bad; see /home/u/x.py, not /v1/models")
    assert msg["error"]["message"] == "base/config.json is bad; see <path>, not /v1/models"
    assert msg["error"] == {**msg["error"], "type": "invalid_request_error", "param": None, "code": 400}


# ---------------------------------------------------------------- checks and tokenization

def check(tokenizer, body: dict, chat: bool = False, live=(3, 4), max_inflight: int = 8):
    return RequestChecker(tokenizer, max_inflight).check(body, chat, live=list(live), base_version=0, engine=ENGINE)


def test_model_is_pinned_to_the_exact_version(tokenizer):
    body = {"model": "policy-latest", "prompt": "abc", "max_tokens": 2}
    checked = check(tokenizer, body)
    assert checked.version == 4 and body["model"] == "policy-v4"
    assert checked.prompt_ids == tokenizer("abc")["input_ids"] and checked.weight == 1
    for model, version in ((None, 0), ("base", 0), ("tiny-model", 0), ("policy-v3", 3)):
        body = {"prompt": "abc"} | ({"model": model} if model else {})
        assert check(tokenizer, body).version == version
        assert body["model"] == ("base" if version == 0 else f"policy-v{version}")
    assert status_of(check, tokenizer, {"model": "../etc/passwd", "prompt": "a"})[0] == 400
    assert status_of(check, tokenizer, {"model": "policy-v9", "prompt": "a"})[0] == 404
    assert status_of(check, tokenizer, {"model": "policy-latest", "prompt": "a"}, live=())[0] == 404


@pytest.mark.parametrize("over,words", [
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_completion_tokens": 2.5}, "max_completion_tokens"),
    ({"n": 9}, "n must be"),
    ({"best_of": "x"}, "best_of"),
    ({"stream": "yes"}, "stream must be a boolean"),
    ({"prompt": ""}, "prompt must be"),
    ({"prompt": [1.5]}, "prompt must be"),
    ({"prompt": ["a", 5]}, "prompt must be"),
    ({"prompt": [10 ** 6]}, "token ids"),
    ({"prompt": [True, False]}, "token ids"),
    ({"prompt": "x" * 64}, "context"),
    ({"prompt": "x" * 100_000}, "characters"),
    ({"prompt": [5] * 70}, "context"),
    ({"max_tokens": 62}, "context"),
    ({"n": 4, "prompt": ["a", "b", "c"]}, "12 sequences"),
])
def test_bad_completion_fields_are_400(tokenizer, over, words):
    status, message = status_of(check, tokenizer, {"model": "base", "prompt": "abc", **over})
    assert status == 400 and words in message, message


def test_weight_is_n_times_prompts(tokenizer):
    checked = check(tokenizer, {"prompt": ["ab", "cd"], "n": 3})
    assert checked.weight == 6 and checked.prompt_ids == tokenizer("ab")["input_ids"]
    assert check(tokenizer, {"prompt": [[1, 2], [3]]}).prompt_ids == [1, 2]


def test_chat_is_tokenized_with_the_chat_template(tokenizer):
    msgs = [{"role": "system", "content": "be short"}, {"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]
    checked = check(tokenizer, {"messages": msgs, "max_tokens": 2}, chat=True)
    joined = [msgs[0], {"role": "user", "content": "hi\nthere"}]
    assert checked.prompt_ids == list(tokenizer.apply_chat_template(
        joined, tokenize=True, return_dict=False, add_generation_prompt=True))
    no_prompt = check(tokenizer, {"messages": msgs, "add_generation_prompt": False}, chat=True)
    assert len(no_prompt.prompt_ids) < len(checked.prompt_ids)


@pytest.mark.parametrize("over,words", [
    ({"messages": "hi"}, "messages must be"),
    ({"messages": []}, "messages must be"),
    ({"messages": ["hi"]}, "messages[0] must be"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "role must be"),
    ({"messages": [{"role": "user", "content": 5}]}, "content must be"),
    ({"messages": [{"role": "user", "content": None}]}, "content must be"),
    ({"messages": [{"role": "user", "content": "x", "name": 3}]}, "name must be"),
    ({"messages": [{"role": "user", "content": "z" * 70}]}, "context"),
    ({"add_generation_prompt": "yes"}, "add_generation_prompt"),
    ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
])
def test_bad_chat_fields_are_400(tokenizer, over, words):
    body = {"model": "base", "messages": [{"role": "user", "content": "hi"}], **over}
    status, message = status_of(check, tokenizer, body, chat=True)
    assert status == 400 and words in message, message


# ---------------------------------------------------------------- the front's flow (fake replicas)

def front(tokenizer, pool: FakePool, live=(3, 4), max_inflight: int = 4, max_body: int = 4096):
    admission = Admission(max_inflight)
    versions = served_versions(list(live))
    checker = RequestChecker(tokenizer, admission.max_inflight)
    return OpenAIRoutes(pool, versions, admission, checker, max_body), admission


def post(body: dict | bytes, **kw):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return make_request([raw], {"content-type": "application/json"}, **kw)


def answer(version: int, sha: str | None) -> dict:
    return {"choices": [{"text": "ok"}], "model": f"policy-v{version}", "version": version, "sha256": sha,
            "replica_id": "r0"}


def test_completion_carries_the_served_version_proof(tokenizer):
    pool = FakePool([answer(4, "sha-4"), answer(4, "forged")])
    openai, admission = front(tokenizer, pool)

    async def go():
        return [await openai.complete(post({"model": "policy-latest", "prompt": "abc"}), COMPLETIONS)
                for _ in range(2)]

    good, forged = asyncio.run(go())
    assert good.status_code == 200 and json.loads(good.body)["model"] == "policy-v4"
    assert "sha256" not in json.loads(good.body)
    assert good.headers["x-policy-version"] == "4" and good.headers["x-adapter-sha256"] == "sha-4"
    method, (path, body), key = pool.calls[0]
    assert (method, path, body["model"]) == ("openai", COMPLETIONS, "policy-v4")
    assert key == {"ids": tokenizer("abc")["input_ids"], "version": 4}
    assert forged.status_code == 200 and admission.counts["version_mismatches"] == 1
    assert admission.inflight == 0


def test_replica_refusals_and_losses(tokenizer):
    refusal = {"error": {"message": "temperature must be >= 0", "type": "BadRequestError", "param": None,
                         "code": 400}, "status_code": 400}
    pool = FakePool([refusal, ReplicaError("policy-v4 is not loaded here", 404), rex.ActorDiedError()])
    openai, admission = front(tokenizer, pool)

    async def go():
        return [await openai.complete(post({"prompt": "abc"}), COMPLETIONS) for _ in range(3)]

    refused, missing, lost = asyncio.run(go())
    assert refused.status_code == 400 and json.loads(refused.body)["error"]["type"] == "invalid_request_error"
    assert missing.status_code == 404 and "not loaded" in json.loads(missing.body)["error"]["message"]
    assert lost.status_code == 503 and lost.headers["retry-after"] == "1"
    assert admission.counts["rejected_4xx"] == 1 and admission.inflight == 0


def test_admission_limits(tokenizer):
    openai, admission = front(tokenizer, FakePool([]), max_inflight=2, max_body=64)

    async def go():
        release = admission.take(2)  # full: refused before the body is read (it never ends)
        busy = await openai.complete(post(b'{"prompt"', stall=True), COMPLETIONS)
        release()
        big = await openai.complete(post({"prompt": "x" * 100}), COMPLETIONS)
        bad = await openai.complete(post(b"[1]"), CHAT)
        return busy, big, bad

    busy, big, bad = asyncio.run(go())
    assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
    assert big.status_code == 413 and bad.status_code == 400
    assert admission.counts["rejected_413"] == 1 and admission.counts["rejected_4xx"] == 1
    assert admission.inflight == 0


def test_request_over_the_limit_by_its_weight_is_429(tokenizer):
    openai, admission = front(tokenizer, FakePool([]), max_inflight=3)

    async def go():
        release = admission.take(2)
        try:
            return await openai.complete(post({"prompt": "abc", "n": 2}), COMPLETIONS)
        finally:
            release()

    r = asyncio.run(go())
    assert r.status_code == 429 and admission.counts["rejected_429"] == 1 and admission.inflight == 0


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def drain(response) -> list[str]:
    return [chunk async for chunk in response.body_iterator]


def test_stream_relays_and_releases(tokenizer):
    chunks = [sse({"choices": [{"text": "a"}], "model": "policy-v4"}), "data: [DONE]\n\n"]
    call = FakeStream(list(chunks))
    openai, admission = front(tokenizer, FakePool(stream_call=call))

    async def go():
        r = await openai.complete(post({"model": "policy-latest", "prompt": "abc", "stream": True}), COMPLETIONS)
        assert admission.inflight == 1  # held until the relay ends
        return r, await drain(r)

    r, got = asyncio.run(go())
    assert r.status_code == 200 and r.headers["x-adapter-sha256"] == "sha-4" and got == chunks
    assert r.headers["x-policy-version"] == "4" and call.sent[1]["model"] == "policy-v4"
    assert call.closed and not call.cancelled and admission.inflight == 0


def test_stream_refused_on_the_first_chunk_gets_its_status(tokenizer):
    refusal = {"error": {"message": "top_p must be in (0, 1]", "type": "BadRequestError", "code": 400},
               "status_code": 400}
    call = FakeStream([sse(refusal)])
    openai, admission = front(tokenizer, FakePool(stream_call=call))
    r = asyncio.run(openai.complete(post({"prompt": "abc", "stream": True}), COMPLETIONS))
    assert r.status_code == 400 and "top_p" in json.loads(r.body)["error"]["message"]
    assert call.closed and call.cancelled and admission.inflight == 0


def test_stream_error_after_the_headers_is_in_band(tokenizer):
    call = FakeStream([sse({"choices": [{"text": "a"}]})], error=rex.ActorDiedError())
    openai, admission = front(tokenizer, FakePool(stream_call=call))

    async def go():
        r = await openai.complete(post({"prompt": "abc", "stream": True}), COMPLETIONS)
        return r, await drain(r)

    r, got = asyncio.run(go())
    assert r.status_code == 200 and got[-1] == "data: [DONE]\n\n"
    assert json.loads(got[-2][len("data: "):])["error"]["code"] == 500
    assert call.closed and admission.inflight == 0


def test_stream_without_a_replica_is_503(tokenizer):
    call = FakeStream([], open_error=rex.ActorDiedError())
    openai, admission = front(tokenizer, FakePool(stream_call=call))
    r = asyncio.run(openai.complete(post({"prompt": "abc", "stream": True}), COMPLETIONS))
    assert r.status_code == 503 and call.closed and admission.inflight == 0


def test_models_lists_base_and_live_versions(tokenizer):
    openai, _ = front(tokenizer, FakePool([]), live=(3, 4))
    data = json.loads(asyncio.run(openai.models()).body)["data"]
    assert [m["id"] for m in data] == ["tiny-model", "base", "policy-v3", "policy-v4", "policy-latest"]
    assert all(m["max_model_len"] == ENGINE["max_model_len"] for m in data)
    assert {m["parent"] for m in data[2:]} == {"tiny-model"}


def test_a_gone_registry_is_503_naming_it_and_a_new_one_is_found(tokenizer):
    """The registry dies with its driver's last handle (the H200 REST benchmark dropped it, and every request
    was a bare 500 "internal error"): the routes answer 503 naming the registry, and the next lookup finds a
    new registry once one is there."""
    from fastapi import FastAPI
    from starlette.testclient import TestClient

    from serve_deployments.openai_body import install_error_handlers
    from serve_deployments.served_versions import ServedVersions
    from tests._ingress_fakes import FakeRegistry

    dead, new = FakeRegistry([4]), FakeRegistry([4, 5])
    dead.gone = rex.ActorDiedError()
    registries = [dead]
    versions = ServedVersions(lambda: registries[-1])
    admission = Admission(4)
    openai = OpenAIRoutes(FakePool([answer(5, "sha-5")]), versions, admission,
                         RequestChecker(tokenizer, admission.max_inflight), 4096)
    app = FastAPI()
    install_error_handlers(app)

    @app.post(COMPLETIONS)
    async def completions(request: Request):
        return await openai.complete(request, COMPLETIONS)

    app.get("/v1/models")(openai.models)
    client = TestClient(app)
    body = {"model": "policy-latest", "prompt": "abc"}
    for r in (client.post(COMPLETIONS, json=body), client.get("/v1/models")):
        assert r.status_code == 503 and r.headers["retry-after"] == "5", (r.status_code, r.text)
        assert "adapter registry cannot be reached" in r.json()["error"]["message"]
        assert "ActorDiedError" in r.json()["error"]["message"]
    assert admission.inflight == 0
    registries.append(new)
    r = client.post(COMPLETIONS, json=body)
    assert r.status_code == 200 and r.headers["x-policy-version"] == "5", r.text


def test_a_gone_registry_is_a_lost_callee_for_rollout_callers_too():
    """The rollout path raises the same error to a rollout worker through Ray, which pickles it without its
    __cause__: it must still read as a lost callee (retried), as the registry's ActorDiedError did."""
    import pickle

    from common.faults import is_lost
    from serve_deployments.served_versions import RegistryGoneError, ServedVersions
    from tests._ingress_fakes import FakeRegistry

    dead = FakeRegistry([4])
    dead.gone = rex.ActorDiedError()
    with pytest.raises(RegistryGoneError) as e:
        asyncio.run(ServedVersions(lambda: dead).live())
    assert is_lost(e.value) and is_lost(pickle.loads(pickle.dumps(e.value)))
