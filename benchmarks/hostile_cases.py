"""The hostile REST cases , shared by tests/test_hostile_rest.py and
benchmarks/bench_reliability.py: (name, method, path, request kwargs for httpx) with the status a case
must get where the spec fixes one (EXPECTED; every other case: any 4xx, never a 5xx or a hang).

`MODEL_DIR` in a case's JSON stands for the server's model directory (substitute it with `materialize`);
admin cases use `TOKEN` as the configured admin token (`rollout.admin_token`)."""
from __future__ import annotations

import copy
import json

TOKEN = "hostile-test-token"
GOOD = {"model": "policy-latest", "prompt": "Say the letter K.", "max_tokens": 3}
GOOD_CHAT = {"model": "policy-latest", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
AUTH = {"Authorization": f"Bearer {TOKEN}"}
OPENAI_TYPES = {"invalid_request_error", "not_found_error", "authentication_error", "permission_error",
                "rate_limit_error"}


def _raw(text: str | bytes) -> dict:
    return {"content": text.encode() if isinstance(text, str) else text,
            "headers": {"content-type": "application/json"}}


def _c(**over) -> dict:
    return {"json": {**GOOD, **over}}


def _chat(**over) -> dict:
    return {"json": {**GOOD_CHAT, **over}}


def _msgs(messages) -> dict:
    return {"json": {**GOOD_CHAT, "messages": messages}}


C, CH = "/v1/completions", "/v1/chat/completions"
MODEL_DIR = "<model_dir>"  # replaced by the real path at run time

CASES = [
    # bad JSON, encodings, surrogates, numbers JSON does not have
    ("not-json", "POST", C, _raw("{not json")),
    ("empty-body", "POST", C, _raw("")),
    ("json-array", "POST", C, _raw("[1, 2]")),
    ("json-string", "POST", C, _raw('"just a string"')),
    ("json-null", "POST", CH, _raw("null")),
    ("truncated", "POST", C, _raw('{"model": "base", "prompt": "ab')),
    ("invalid-utf8", "POST", C, _raw(b"\xff\xfe{}")),
    ("invalid-utf8-in-string", "POST", C, _raw(b'{"model": "base", "prompt": "\xc3\x28", "max_tokens": 2}')),
    ("utf8-bom", "POST", C, _raw(b"\xef\xbb\xbf" + json.dumps(GOOD).encode())),
    ("lone-surrogate-prompt", "POST", C, _raw('{"model": "base", "prompt": "\\ud800abc", "max_tokens": 2}')),
    ("lone-surrogate-stop", "POST", C, _raw('{"prompt": "abc", "max_tokens": 2, "stop": ["\\udfff"]}')),
    ("lone-surrogate-bad-words", "POST", C, _raw('{"prompt": "abc", "max_tokens": 2, "bad_words": ["\\ud800"]}')),
    ("lone-surrogate-chat", "POST", CH, _raw('{"messages": [{"role": "user", "content": "hi \\udc00"}]}')),
    ("lone-surrogate-key", "POST", C, _raw('{"\\ud800": 1, "prompt": "abc"}')),
    ("nan", "POST", C, _raw('{"prompt": "abc", "temperature": NaN}')),
    ("infinity", "POST", C, _raw('{"prompt": "abc", "top_p": -Infinity}')),
    ("float-overflow", "POST", C, _raw('{"prompt": "abc", "temperature": 1e999}')),
    ("deep-nesting", "POST", C, _raw("[" * 100_000 + "]" * 100_000)),
    ("nesting-over-limit", "POST", C, _raw('{"prompt": "abc", "x": ' + "[" * 40 + "]" * 40 + "}")),
    ("int-5000-digits", "POST", C, _raw('{"prompt": "abc", "max_tokens": ' + "9" * 5000 + "}")),
    ("int-over-int64", "POST", C, _c(top_k=2 ** 70)),
    # wrong types and out-of-range sampling parameters
    ("max-tokens-negative", "POST", C, _c(max_tokens=-3)),
    ("max-tokens-string", "POST", C, _c(max_tokens="ten")),
    ("max-tokens-float", "POST", C, _c(max_tokens=2.5)),
    ("max-tokens-bool", "POST", C, _c(max_tokens=True)),
    ("max-completion-tokens-zero", "POST", CH, _chat(max_completion_tokens=0)),
    ("temperature-negative", "POST", C, _c(temperature=-1)),
    ("temperature-string", "POST", C, _c(temperature="hot")),
    ("temperature-huge", "POST", C, _c(temperature=1e308)),
    ("top-p-zero", "POST", C, _c(top_p=0)),
    ("top-p-over-one", "POST", C, _c(top_p=1.5)),
    ("top-k-negative", "POST", C, _c(top_k=-5)),
    ("min-p-over-one", "POST", C, _c(min_p=2)),
    ("n-zero", "POST", C, _c(n=0)),
    ("n-huge", "POST", C, _c(n=10 ** 6)),
    ("best-of-string", "POST", C, _c(best_of="x")),
    ("logprobs-1000", "POST", C, _c(logprobs=1000)),
    ("presence-penalty-5", "POST", C, _c(presence_penalty=5)),
    ("frequency-penalty-string", "POST", C, _c(frequency_penalty="x")),
    ("repetition-penalty-zero", "POST", C, _c(repetition_penalty=0)),
    ("stop-int", "POST", C, _c(stop=5)),
    ("stop-token-ids-out-of-vocab", "POST", C, _c(stop_token_ids=[10 ** 9])),
    ("logit-bias-bad-key", "POST", C, _c(logit_bias={"x": 5})),
    ("logit-bias-out-of-vocab", "POST", C, _c(logit_bias={"999999": 5})),
    ("min-tokens-over-max", "POST", C, _c(min_tokens=100)),
    ("seed-on-cpu", "POST", C, _c(seed=1)),
    ("response-format-nonsense", "POST", C, _c(response_format={"type": "nonsense"})),
    ("stream-string", "POST", C, _c(stream="yes")),
    ("stream-bad-temperature", "POST", C, _c(stream=True, temperature=-1)),
    ("stream-chat-bad-top-p", "POST", CH, _chat(stream=True, top_p=7)),
    ("prompt-int", "POST", C, _c(prompt=5)),
    ("prompt-empty-string", "POST", C, _c(prompt="")),
    ("prompt-empty-list", "POST", C, _c(prompt=[])),
    ("prompt-missing", "POST", C, {"json": {"model": "base", "max_tokens": 2}}),
    ("prompt-floats", "POST", C, _c(prompt=[1.5, 2.5])),
    ("prompt-negative-id", "POST", C, _c(prompt=[-1, 5])),
    ("prompt-out-of-vocab-id", "POST", C, _c(prompt=[10 ** 6])),
    ("prompt-bools", "POST", C, _c(prompt=[True, False])),
    ("prompt-mixed-list", "POST", C, _c(prompt=["a", 5])),
    # unknown or malformed model names, path-like ones included
    ("model-unknown", "POST", C, _c(model="gpt-17")),
    ("model-parent-traversal", "POST", C, _c(model="../x")),
    ("model-etc-passwd", "POST", C, _c(model="/etc/passwd")),
    ("model-server-path", "POST", C, _c(model=MODEL_DIR)),
    ("model-server-path-chat", "POST", CH, _chat(model=MODEL_DIR)),
    ("model-latest-traversal", "POST", C, _c(model="policy-latest/../../x")),
    ("model-encoded-traversal", "POST", C, _c(model="..%2f..%2fetc%2fpasswd")),
    ("model-newline", "POST", C, _c(model="policy-v1\n")),
    ("model-very-long", "POST", C, _c(model="x" * 10_000)),
    ("model-int", "POST", C, _c(model=123)),
    ("model-list", "POST", C, _c(model=["policy-v1"])),
    ("model-policy-v0", "POST", C, _c(model="policy-v0")),
    ("model-policy-not-live", "POST", C, _c(model="policy-v999999")),
    # prompts longer than the context
    ("prompt-over-context", "POST", C, _c(prompt="x" * 600)),
    ("prompt-far-over-context", "POST", C, _c(prompt="x" * 200_000)),
    ("prompt-ids-over-context", "POST", C, _c(prompt=[5] * 600)),
    ("prompt-list-one-over-context", "POST", C, _c(prompt=["ok", "y" * 700])),
    ("max-tokens-over-context", "POST", C, _c(max_tokens=10 ** 6)),
    ("chat-over-context", "POST", CH, _msgs([{"role": "user", "content": "z" * 600}])),
    # chat messages of the wrong shape
    ("messages-string", "POST", CH, _msgs("hi")),
    ("messages-empty", "POST", CH, _msgs([])),
    ("messages-missing", "POST", CH, {"json": {"model": "base", "prompt": "hi"}}),
    ("message-not-object", "POST", CH, _msgs(["hi"])),
    ("message-no-role", "POST", CH, _msgs([{"content": "hi"}])),
    ("message-unknown-role", "POST", CH, _msgs([{"role": "wizard", "content": "x"}])),
    ("message-content-int", "POST", CH, _msgs([{"role": "user", "content": 5}])),
    ("message-content-missing", "POST", CH, _msgs([{"role": "user"}])),
    ("message-content-dict", "POST", CH, _msgs([{"role": "user", "content": {"text": "hi"}}])),
    ("message-image-file-url", "POST", CH, _msgs([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}])),
    ("message-text-part-no-text", "POST", CH, _msgs([{"role": "user", "content": [{"type": "text"}]}])),
    ("message-name-int", "POST", CH, _msgs([{"role": "user", "content": "hi", "name": 5}])),
    ("chat-template-kwargs-reserved", "POST", CH, _chat(chat_template_kwargs={"tokenize": False})),
    ("chat-template-kwargs-list", "POST", CH, _chat(chat_template_kwargs=[1])),
    ("chat-template-untrusted", "POST", CH, _chat(chat_template="{{ 7 * 7 }}")),
    ("add-generation-prompt-string", "POST", CH, _chat(add_generation_prompt="yes")),
    # admin routes: no token, wrong token, traversal-like paths
    ("admin-pause-no-token", "POST", "/admin/pause", {}),
    ("admin-stats-wrong-token", "GET", "/admin/stats", {"headers": {"Authorization": "Bearer wrong"}}),
    ("admin-token-prefix", "POST", "/admin/resume", {"headers": {"Authorization": f"Bearer {TOKEN[:-1]}"}}),
    ("admin-token-longer", "POST", "/admin/resume", {"headers": {"Authorization": f"Bearer {TOKEN}x"}}),
    ("admin-basic-auth", "DELETE", "/admin/adapters/1", {"headers": {"Authorization": f"Basic {TOKEN}"}}),
    ("admin-bare-token", "POST", "/admin/adapters/1", {"headers": {"Authorization": TOKEN}}),
    ("admin-traversal-no-token", "POST", "/admin/adapters/..%2F..%2Fetc%2Fpasswd", {}),
    ("admin-dot-segments-no-token", "GET", "/admin/%2e%2e/%2e%2e/etc/passwd", {}),
    ("admin-unknown-no-token", "GET", "/admin/secrets", {}),
    ("admin-traversal-with-token", "POST", "/admin/adapters/..%2F..%2Fetc%2Fpasswd", {"headers": AUTH}),
    ("admin-path-version-with-token", "POST", "/admin/adapters/%2Fetc%2Fpasswd", {"headers": AUTH}),
    ("admin-version-zero", "POST", "/admin/adapters/0", {"headers": AUTH}),
    ("admin-version-negative", "DELETE", "/admin/adapters/-1", {"headers": AUTH}),
    ("admin-version-huge", "POST", "/admin/adapters/99999999999999999999999", {"headers": AUTH}),
    ("admin-version-not-held", "POST", "/admin/adapters/policy-v424242", {"headers": AUTH}),
    # routes and methods that do not exist
    ("get-completions", "GET", C, {}),
    ("unknown-route", "POST", "/v1/nope", {"json": GOOD}),
    ("path-traversal-route", "GET", "/%2e%2e/%2e%2e/etc/passwd", {}),
]
EXPECTED = {  # cases whose status is fixed by the spec; every other case: any 4xx
    "model-unknown": 404, "model-policy-not-live": 404, "model-policy-v0": 404,
    "model-server-path": 400, "model-etc-passwd": 400, "model-parent-traversal": 400,
    "admin-pause-no-token": 401, "admin-stats-wrong-token": 401, "admin-token-prefix": 401,
    "admin-token-longer": 401, "admin-basic-auth": 401, "admin-bare-token": 401,
    "admin-traversal-no-token": 401, "admin-dot-segments-no-token": 401, "admin-unknown-no-token": 401,
    "admin-version-not-held": 404, "get-completions": 405, "unknown-route": 404,
    "stream-bad-temperature": 400, "stream-chat-bad-top-p": 400,
}


def materialize(kw: dict, model_dir) -> dict:
    """A case's request kwargs with MODEL_DIR replaced by the server's model directory."""
    kw = copy.deepcopy(kw)
    if "json" in kw:
        kw["json"] = {k: (str(model_dir) if v == MODEL_DIR else v) for k, v in kw["json"].items()}
    return kw


def openai_error_problem(status: int, text: str, forbidden: list[str], want: int | None = None) -> str | None:
    """What is wrong with a response to a hostile case, or None: the status (the expected one, else a
    4xx), the OpenAI error body shape, and no server path in it."""
    if (want is not None and status != want) or not 400 <= status < 500:
        return f"status {status}" + (f", expected {want}" if want else ", expected a 4xx")
    try:
        body = json.loads(text)
    except ValueError:
        return "body is not JSON"
    err = body.get("error") if isinstance(body, dict) else None
    if set(body) != {"error"} or not isinstance(err, dict) or not {"message", "type", "param", "code"} <= set(err):
        return "not an OpenAI error body"
    if err["code"] != status or not err["message"] or err["type"] not in OPENAI_TYPES:
        return "error code/message/type wrong"
    leaked = [b for b in forbidden if b in text]
    return f"reveals {leaked[0]!r}" if leaked else None
