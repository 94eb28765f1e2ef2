"""Tools for multi-turn environments: describe Python functions to the model, run the calls it writes.

`ToolBox(fns).schemas` goes to the chat template's `tools=`; `await ToolBox.run(assistant_text)` parses the
Qwen/Hermes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks in the text, runs each call
under a timeout and returns `tool` role messages, one per call, in the order the calls appear. A malformed
call, an unknown tool, arguments that do not fit, a tool that raises or times out all become a message whose
content starts with "error: " (the model sees what went wrong and may try again); `run` never raises (a
cancellation from outside, e.g. env.step_timeout_s, still goes through).

A complete environment (config `env.cls: mypkg.env:CalcEnv`; the rollout builds `CalcEnv(row)` per episode):

    from app.tools import ToolBox

    def add(a: float, b: float) -> float:
        '''Add two numbers.

        Args:
            a: The first number.
            b: The second number.
        '''
        return a + b

    class CalcEnv:
        def __init__(self, row: dict):
            self.row = row
            self.toolbox = ToolBox([add], timeout_s=5.0, max_calls=2)
            self.tools = self.toolbox.schemas  # the rollout passes env.tools to the chat template (app/envs.py)

        def reset(self) -> list[dict]:
            return [{"role": "system", "content": "Use the add tool, then answer with the number alone."},
                    {"role": "user", "content": self.row["prompt"]}]

        async def step(self, assistant_text: str) -> dict:
            result = await self.toolbox.run(assistant_text)
            if result.messages:  # the model called tools: show it the results, episode goes on
                return {"observations": result.messages, "reward": None, "done": False}
            reward = 1.0 if assistant_text.strip() == self.row["answer"] else 0.0
            return {"observations": [], "reward": reward, "done": True}

Calls run one after another (a later call may depend on an earlier one's effect on the environment), so a
turn takes at most max_calls x timeout_s in tools. A sync tool that times out keeps its worker thread until it
returns (Python cannot stop a thread): tools that may hang should be async or bound their own work.
"""
from __future__ import annotations

import asyncio
import copy
import inspect
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from transformers.utils import get_json_schema

_START, _END = "<tool_call>", "</tool_call>"
_MAX_ERROR_CHARS = 300  # an exception message is for the model to read, not a traceback dump


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str


@dataclass
class ToolResult:
    messages: list[dict]  # role "tool", in the order of the calls in the text
    calls: int  # well-formed calls within max_calls, i.e. the ones run (successfully or not)
    errors: int  # messages that are errors: malformed or extra calls, and calls that failed


def _error(text: str) -> str:
    return "error: " + text


def _short(exc: BaseException) -> str:
    msg = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return msg if len(msg) <= _MAX_ERROR_CHARS else msg[:_MAX_ERROR_CHARS] + "..."


class ToolBox:
    def __init__(self, tools: list[Callable], timeout_s: float = 10.0, max_calls: int = 4):
        if timeout_s <= 0 or max_calls < 1:
            raise ValueError(f"ToolBox: timeout_s must be > 0 and max_calls >= 1, got {timeout_s}, {max_calls}")
        self.timeout_s, self.max_calls = timeout_s, max_calls
        self._fns: dict[str, Callable] = {}
        self._schemas: list[dict] = []
        for fn in tools:
            name = getattr(fn, "__name__", repr(fn))
            try:
                schema = get_json_schema(fn)
            except Exception as e:  # transformers raises its own types; get_type_hints may raise NameError
                raise ValueError(f"ToolBox: cannot describe tool {name!r}: {_short(e)}") from e
            # get_json_schema lists *args/**kwargs as ordinary required arguments, and a positional-only one
            # could never be passed from a JSON object: refuse both rather than offer calls that cannot bind.
            odd = [p.name for p in inspect.signature(fn).parameters.values()
                   if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
            if odd:
                raise ValueError(f"ToolBox: tool {name!r} has parameters a JSON object cannot pass: {odd}")
            # transformers adds "return" (the return hint); OpenAI's format has no such key and REST clients
            # never send it, so drop it: the model sees tools rendered the same in training and serving.
            schema["function"].pop("return", None)
            name = schema["function"]["name"]
            if name in self._fns:
                raise ValueError(f"ToolBox: two tools are named {name!r}")
            self._fns[name] = fn
            self._schemas.append(schema)

    @property
    def schemas(self) -> list[dict]:
        """OpenAI function-tool dicts for `apply_chat_template(tools=...)` (a copy: callers may edit it)."""
        return copy.deepcopy(self._schemas)

    def parse(self, text: str) -> tuple[list[ToolCall], list[str]]:
        """The well-formed calls in `text` (at most max_calls) and one "error: ..." string per other call."""
        items = self._scan(text)
        return [i for i in items if isinstance(i, ToolCall)], [i for i in items if isinstance(i, str)]

    async def run(self, text: str) -> ToolResult:
        """Parse `text` and run its calls in order; one `tool` message per call, errors included."""
        messages, calls, errors = [], 0, 0
        try:
            items = self._scan(text)
        except Exception as e:  # run never raises; _scan should not either, but the text is the model's
            items = [_error(f"could not read tool calls: {_short(e)}")]
        for item in items:
            if isinstance(item, str):
                messages.append({"role": "tool", "content": item})
                errors += 1
                continue
            calls += 1
            try:
                content, ok = await self._call(item)
            except Exception as e:  # the contract: a failure is an observation, never a raise
                content, ok = _error(f"tool {item.name!r} failed: {_short(e)}"), False
            errors += not ok
            messages.append({"role": "tool", "name": item.name, "tool_call_id": item.id, "content": content})
        return ToolResult(messages=messages, calls=calls, errors=errors)

    # Text-level twin of vLLM's Hermes2ProToolParser.extract_tool_calls (vllm/tool_parsers/
    # hermes_tool_parser.py): same tags, body between them stripped and json.loads'ed, "name" and "arguments"
    # required. vLLM's parser needs a tokenizer with <tool_call> special tokens, which the project's tiny
    # character-level model lacks, hence this one. Differences, on purpose: vLLM fails the whole text when any
    # call is bad and accepts a final unclosed <tool_call> whose body parses; here each call fails on its own
    # (the model learns which one was wrong) and an unclosed tag is malformed (usually a turn cut at
    # max_tokens). Arguments given as a JSON string holding an object are accepted (vLLM would pass the
    # string on as is).
    def _scan(self, text: str) -> list[ToolCall | str]:
        items: list[ToolCall | str] = []
        pos, n, ok = 0, 0, 0
        while (start := text.find(_START, pos)) != -1:
            n += 1
            body_at = start + len(_START)
            end = text.find(_END, body_at)
            if end == -1:
                items.append(_error(f"tool call {n} has no closing {_END}"))
                break
            pos = end + len(_END)
            item = self._read_call(n, text[body_at:end].strip())
            if isinstance(item, ToolCall):
                ok += 1
                if ok > self.max_calls:
                    item = _error(f"tool call {n} ({item.name}) is over the limit of {self.max_calls} calls "
                                  "per turn; it was not run")
            items.append(item)
        return items

    @staticmethod
    def _read_call(n: int, body: str) -> ToolCall | str:
        try:
            obj = json.loads(body)
        except ValueError as e:
            return _error(f"tool call {n} is not valid JSON ({e})")
        if not isinstance(obj, dict):
            return _error(f'tool call {n} is not a JSON object {{"name": ..., "arguments": {{...}}}}')
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            return _error(f"tool call {n} has no \"name\" string")
        if "arguments" not in obj:
            return _error(f"tool call {n} ({name}) has no \"arguments\"")
        args = obj["arguments"]
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError as e:
                return _error(f"tool call {n} ({name}): \"arguments\" is a string that is not valid JSON ({e})")
        if not isinstance(args, dict):
            return _error(f"tool call {n} ({name}): \"arguments\" is not a JSON object")
        # Random like vLLM's make_tool_call_id: ids stay unique across the turns of an episode.
        return ToolCall(name=name, arguments=args, id=f"call_{uuid.uuid4().hex[:24]}")

    async def _call(self, call: ToolCall) -> tuple[str, bool]:
        """(content, ok); a tool's own str result is never taken for an error, whatever it says."""
        fn = self._fns.get(call.name)
        if fn is None:
            return _error(f"unknown tool {call.name!r} (known: {', '.join(self._fns)})"), False
        try:
            inspect.signature(fn).bind(**call.arguments)
        except TypeError as e:
            return _error(f"bad arguments for {call.name!r}: {e}"), False
        work = fn(**call.arguments) if inspect.iscoroutinefunction(fn) else asyncio.to_thread(fn, **call.arguments)
        try:
            result = await asyncio.wait_for(work, self.timeout_s)
            if inspect.isawaitable(result):  # an object with an async __call__, or a wrapper returning a coroutine
                result = await asyncio.wait_for(result, self.timeout_s)
        except asyncio.TimeoutError:  # not the builtin: they differ on Python 3.10
            return _error(f"tool {call.name!r} timed out after {self.timeout_s:g} s"), False
        except Exception as e:  # the tool's own failure, shown to the model
            return _error(f"tool {call.name!r} raised {_short(e)}"), False
        if isinstance(result, str):
            return result, True
        try:
            return json.dumps(result, ensure_ascii=False, allow_nan=False), True
        except (TypeError, ValueError) as e:
            return _error(f"tool {call.name!r} returned a result that is not JSON-serializable ({_short(e)})"), False
