"""What a REST completion / chat completion must be before a replica sees it, and its prompt's tokens.

The ingress checks only what it needs to route and admit a request: the model (pinned to the exact
version it runs under, openai_api.resolve_model), `stream`, the token budget (`max_tokens`,
`max_completion_tokens`), `n` / `best_of` against the in-flight limit, and the prompt, tokenized with the
model's tokenizer (chat messages through its chat template, with the request's `tools` the way vLLM renders
them) for the route key and the context check. Tool calling (`tools`, `tool_choice`, tool and assistant
tool-call messages) is checked for shape here, so a malformed one is a 400 naming the field and never
reaches vLLM's validators, some of which index into it unchecked.
Everything else (sampling ranges, stop strings, logit bias, ...) is checked on the replica by vLLM's own
request models (CompletionRequest / ChatCompletionRequest), whose 4xx the front passes through.
No Ray, no Serve: unit-tested with the tiny model's tokenizer (tests/test_openai_front.py).
"""
from __future__ import annotations

import json
import re
from typing import NamedTuple

from serve_deployments.openai_api import ModelNameError, openai_type, resolve_model, served_name
from serve_deployments.openai_body import INT64, APIError

ROLES = ("system", "developer", "user", "assistant", "tool")
# apply_chat_template arguments a client's chat_template_kwargs must not override.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})
MAX_TOOLS = 128  # OpenAI's limit; every tool's schema may become a grammar the engine compiles
# OpenAI's function-name characters, plus `.` and `:` (namespaced tools): names end up inside the tool
# parser's regexes and the engine's grammar, so quotes, braces and control characters stay out.
TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
TOOL_CHOICES = ("none", "auto", "required")


class CheckedRequest(NamedTuple):
    prompt_ids: list[int]  # the (first) prompt's token ids: the route key's source
    version: int  # the exact version the request runs under (its `model` now names it)
    weight: int  # sequences asked for (n x prompts): its weight against the in-flight limit


class RequestChecker:
    """Checks and tokenizes REST request bodies with one tokenizer (any Hugging Face tokenizer)."""

    def __init__(self, tokenizer, max_inflight: int):
        self._tok = tokenizer
        self._vocab = len(tokenizer)
        # A prompt of more characters than this per token of context cannot fit: refused without tokenizing.
        self._max_token_chars = max(1, max((len(t) for t in tokenizer.get_vocab()), default=1))
        self._max_inflight = max_inflight

    def check(self, body: dict, chat: bool, *, live: list[int], base_version: int, engine: dict,
              run: str = "") -> CheckedRequest:
        """Check `body` (a completion, or a chat completion if `chat`) for an engine of `engine_info`
        facts, with run `run`'s `live` versions offered and the base weights at `base_version`; sets
        `body["model"]` to the exact version's public id. Raises APIError."""
        try:
            version = resolve_model(body.get("model"), live, base_version, engine["model"], run)
        except ModelNameError as e:
            raise APIError(e.status, e.message, openai_type(e.status), "model") from None
        body["model"] = served_name(version, run)
        if not isinstance(body.get("stream", False), (bool, type(None))):
            raise APIError(400, f"stream must be a boolean, got {_show(body['stream'])}", param="stream")
        limit = engine["max_model_len"]
        max_new = 0
        for field in ("max_tokens", "max_completion_tokens"):
            max_new = _int_field(body, field, 1, INT64) or max_new
        n = _int_field(body, "n", 1, self._max_inflight) or 1
        _int_field(body, "best_of", 1, self._max_inflight)
        prompts = self._chat_ids(body, limit) if chat else self._completion_ids(body.get("prompt"), limit)
        for ids in prompts:
            if len(ids) >= limit or len(ids) + max_new > limit:
                raise APIError(400, f"prompt is {len(ids)} tokens and max_tokens {max_new}; the context "
                                    f"is {limit} tokens (prompt + completion must fit)", param="prompt")
        weight = n * len(prompts)
        if weight > self._max_inflight:
            raise APIError(400, f"the request asks for {weight} sequences (n x prompts); this server admits at "
                                f"most {self._max_inflight} at once", param="n")
        return CheckedRequest(prompts[0], version, weight)

    def _encode(self, text: str, limit: int) -> list[int]:
        if len(text) > self._max_token_chars * limit:  # cannot fit whatever it tokenizes to
            raise APIError(400, f"prompt is {len(text)} characters; it cannot fit the context of {limit} tokens",
                           param="prompt")
        return self._tok(text)["input_ids"]

    def _token_ids(self, ids: list, limit: int) -> list[int]:
        if len(ids) >= limit:
            raise APIError(400, f"prompt is {len(ids)} tokens; the context is {limit} tokens", param="prompt")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self._vocab for t in ids):
            raise APIError(400, f"prompt token ids must be integers in [0, {self._vocab})", param="prompt")
        return list(ids)

    def _completion_ids(self, prompt, limit: int) -> list[list[int]]:
        if isinstance(prompt, str) and prompt:
            return [self._encode(prompt, limit)]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return [self._token_ids(prompt, limit)]
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) and p for p in prompt):
            return [self._encode(p, limit) for p in prompt]
        if isinstance(prompt, list) and prompt and all(
                isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
            return [self._token_ids(p, limit) for p in prompt]
        raise APIError(400, "prompt must be a non-empty string, list of strings, or token id list(s)", param="prompt")

    def _chat_ids(self, body: dict, limit: int) -> list[list[int]]:
        msgs = check_messages(body.get("messages"))
        tools = check_tools(body)
        chars = sum(len(m["content"]) for m in msgs if isinstance(m.get("content"), str))
        if chars > self._max_token_chars * limit:
            raise APIError(400, f"messages hold {chars} characters; they cannot fit the context of {limit} tokens",
                           param="messages")
        flags = {}
        for field, default in (("add_generation_prompt", True), ("continue_final_message", False)):
            value = body.get(field, default)
            if not isinstance(value, bool):
                raise APIError(400, f"{field} must be a boolean, got {_show(value)}", param=field)
            flags[field] = value
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict) or _RESERVED_TEMPLATE_KWARGS & set(kwargs):
            what = (", ".join(sorted(_RESERVED_TEMPLATE_KWARGS & set(kwargs))) if isinstance(kwargs, dict)
                    else "a " + type(kwargs).__name__)
            raise APIError(400, f"chat_template_kwargs must be an object of template variables (not {what})",
                           param="chat_template_kwargs")
        try:
            text = self._tok.apply_chat_template(template_messages(msgs), tools=tools, tokenize=False, **flags,
                                                 **kwargs)
        except Exception as e:
            raise APIError(400, f"messages could not be rendered with the chat template: {e}",
                           param="messages") from None
        # Tool schemas are rendered into the prompt by templates that support tools: the rendered text is
        # bounded before it is tokenized, like the messages are above.
        if len(text) > self._max_token_chars * limit:
            raise APIError(400, f"the rendered prompt is {len(text)} characters; it cannot fit the context of "
                                f"{limit} tokens", param="tools" if tools else "messages")
        # What apply_chat_template(tokenize=True) does, and vLLM too: the template holds the special tokens.
        return [list(self._tok(text, add_special_tokens=False)["input_ids"])]


def check_messages(msgs) -> list[dict]:
    """Chat messages of the shape OpenAI accepts: {role, content} with a known role and text content
    (a string or a list of {type: text, text} parts, joined the way vLLM joins them); assistant turns
    with `tool_calls` may have no content, tool turns need `tool_call_id`. Raises APIError."""
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, msg in enumerate(msgs):
        if not isinstance(msg, dict):
            raise APIError(400, f"messages[{i}] must be an object with role and content", param="messages")
        if msg.get("role") not in ROLES:
            raise APIError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}", param="messages")
        if msg["role"] == "assistant" and msg.get("tool_calls") is not None:
            _check_tool_calls(msg["tool_calls"], f"messages[{i}].tool_calls")
        content = msg.get("content")
        if isinstance(content, list) and content and all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            msg = dict(msg, content="\n".join(p["text"] for p in content))
        elif not (isinstance(content, str) or (content is None and msg["role"] == "assistant"
                                               and msg.get("tool_calls"))):
            raise APIError(400, f"messages[{i}].content must be a string or a list of text parts "
                                "({type: text, text: string})", param="messages")
        if "name" in msg and not isinstance(msg["name"], str):
            raise APIError(400, f"messages[{i}].name must be a string", param="messages")
        if msg["role"] == "tool" and not (isinstance(msg.get("tool_call_id"), str) and msg["tool_call_id"]):
            raise APIError(400, f"messages[{i}].tool_call_id must be the id of the tool call this message answers "
                                "(a non-empty string)", param="messages")
        out.append(msg)
    return out


def _check_tool_calls(calls, where: str) -> None:
    """An assistant turn's tool_calls: [{id, type: function, function: {name, arguments}}] (arguments a
    JSON string, as OpenAI sends it, or an object)."""
    if not isinstance(calls, list):
        raise APIError(400, f"{where} must be a list of tool calls", param="messages")
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(fn, dict) or call.get("type", "function") != "function"
                or not isinstance(call.get("id", ""), str)):
            raise APIError(400, f"{where}[{j}] must be {{id, type: function, function: {{name, arguments}}}}",
                           param="messages")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(400, f"{where}[{j}].function.name must be a non-empty string", param="messages")
        if not isinstance(fn.get("arguments", ""), (str, dict)):
            raise APIError(400, f"{where}[{j}].function.arguments must be a JSON string", param="messages")


def template_messages(msgs: list[dict]) -> list[dict]:
    """Checked messages as vLLM hands them to the chat template: no content is "" and tool-call arguments
    are objects (vLLM's chat_utils._postprocess_messages; arguments that are not a JSON object become {})."""
    out = []
    for msg in msgs:
        if msg.get("content") is None:
            msg = dict(msg, content="")
        if msg["role"] == "assistant" and isinstance(msg.get("tool_calls"), list):
            calls = [dict(c, function=dict(c["function"], arguments=_arguments(c["function"].get("arguments"))))
                     for c in msg["tool_calls"]]
            msg = dict(msg, tool_calls=calls)
            if not calls:
                del msg["tool_calls"]
        out.append(msg)
    return out


def _arguments(args) -> dict:
    if isinstance(args, str) and args:
        try:
            args = json.loads(args)
        except ValueError:
            return {}
    return args if isinstance(args, dict) else {}


def check_tools(body: dict) -> list[dict] | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat request; returns the tools as vLLM renders
    them into the chat template (ChatCompletionToolsParam.model_dump()), None without tools. Raises APIError."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None:
        if not isinstance(tools, list) or not tools or len(tools) > MAX_TOOLS:
            raise APIError(400, f"tools must be a non-empty list of at most {MAX_TOOLS} "
                                "{type: function, function: {name, description, parameters}} objects", param="tools")
        tools = [_check_tool(t, i) for i, t in enumerate(tools)]
    if not isinstance(body.get("parallel_tool_calls", True), (bool, type(None))):
        raise APIError(400, f"parallel_tool_calls must be a boolean, got {_show(body['parallel_tool_calls'])}",
                       param="parallel_tool_calls")
    if choice is None or choice == "none":
        return tools
    usage = ('tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}, '
             f"got {_show(choice)}")
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type", "function") != "function" or not isinstance(fn, dict) or not isinstance(
                fn.get("name"), str):
            raise APIError(400, usage, param="tool_choice")
    elif choice not in TOOL_CHOICES:
        raise APIError(400, usage, param="tool_choice")
    if tools is None:
        raise APIError(400, f"tool_choice {_show(choice)} needs tools", param="tool_choice")
    if isinstance(choice, dict) and choice["function"]["name"] not in {t["function"]["name"] for t in tools}:
        raise APIError(400, f"tool_choice names function {_show(choice['function']['name'])}, which is not in tools",
                       param="tool_choice")
    return tools


def _check_tool(tool, i: int) -> dict:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or tool.get("type", "function") != "function":
        raise APIError(400, f"tools[{i}] must be {{type: function, function: {{name, description, parameters}}}}",
                       param="tools")
    if not isinstance(fn.get("name"), str) or not TOOL_NAME.fullmatch(fn["name"]):
        raise APIError(400, f"tools[{i}].function.name must be 1-64 characters of a-z, A-Z, 0-9, _ . : -",
                       param="tools")
    for field, types, what in (("description", str, "a string"), ("parameters", dict, "a JSON Schema object"),
                               ("strict", bool, "a boolean")):
        if fn.get(field) is not None and not isinstance(fn[field], types):
            raise APIError(400, f"tools[{i}].function.{field} must be {what}", param="tools")
    out = {"name": fn["name"], "description": fn.get("description"), "parameters": fn.get("parameters")}
    if fn.get("strict") is not None:
        out["strict"] = fn["strict"]
    return {"type": "function", "function": out}


def _int_field(body: dict, field: str, lo: int, hi: int) -> int | None:
    value = body.get(field)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise APIError(400, f"{field} must be an integer in [{lo}, {hi}], got {_show(value)}", param=field)
    return value


def _show(value) -> str:
    text = json.dumps(value, ensure_ascii=True)
    return text if len(text) <= 40 else text[:37] + "..."
