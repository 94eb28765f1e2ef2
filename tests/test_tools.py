"""app.tools.ToolBox: schemas from real functions (transformers' get_json_schema), Hermes-format parsing, and
running calls with a timeout. Pure Python, no Ray or vLLM."""
import asyncio
import json
import time
from typing import Literal

import pytest

from app.tools import ToolBox, ToolCall, ToolResult


def add(a: float, b: float = 0.0) -> float:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def lookup(key: str, mode: Literal["exact", "prefix"] = "exact", limit: int | None = None) -> dict:
    """Look a key up in a tiny table.

    Args:
        key: The key to find.
        mode: How to match the key.
        limit: Most rows to return.
    """
    return {"key": key, "mode": mode, "limit": limit}


def boom(x: int) -> int:
    """Always fails.

    Args:
        x: Ignored.
    """
    raise RuntimeError(f"kaput {x}")


def nap(s: float) -> str:
    """Sleep, then say so.

    Args:
        s: Seconds to sleep.
    """
    time.sleep(s)
    return "awake"


async def anap(s: float) -> str:
    """Sleep without blocking, then say so.

    Args:
        s: Seconds to sleep.
    """
    await asyncio.sleep(s)
    return "awake"


def a_set() -> set:
    """Returns something json cannot write."""
    return {1, 2}


def call(name: str, arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@pytest.fixture
def box() -> ToolBox:
    return ToolBox([add, lookup, boom, nap, anap, a_set], timeout_s=0.2, max_calls=3)


def run(box: ToolBox, text: str) -> ToolResult:
    return asyncio.run(box.run(text))


# -- schemas ----------------------------------------------------------------------------------------------------


def test_schemas_from_typed_documented_functions(box):
    by_name = {s["function"]["name"]: s for s in box.schemas}
    assert list(by_name) == ["add", "lookup", "boom", "nap", "anap", "a_set"]
    assert all(s["type"] == "function" for s in by_name.values())
    f = by_name["add"]["function"]
    assert f["description"] == "Add two numbers."
    assert f["parameters"]["properties"]["a"] == {"type": "number", "description": "The first number."}
    assert f["parameters"]["required"] == ["a"]  # b has a default
    assert "return" not in f  # OpenAI format: name, description, parameters only
    props = by_name["lookup"]["function"]["parameters"]["properties"]
    assert props["key"]["type"] == "string"
    assert props["mode"]["enum"] == ["exact", "prefix"]
    assert props["limit"]["type"] == "integer" and props["limit"]["nullable"] is True
    assert by_name["lookup"]["function"]["parameters"]["required"] == ["key"]
    box.schemas[0]["function"]["name"] = "changed"  # a copy: the box's own stays as it was
    assert box.schemas[0]["function"]["name"] == "add"


def test_undescribable_function_is_a_value_error_naming_it():
    def undocumented(x: int) -> int:
        return x

    def untyped(x):
        """No hint.

        Args:
            x: Something.
        """

    def varargs(*xs: int) -> int:
        """Many.

        Args:
            xs: Numbers.
        """

    with pytest.raises(ValueError, match=r"'undocumented'.*no docstring"):
        ToolBox([undocumented])
    with pytest.raises(ValueError, match=r"'untyped'.*missing a type hint"):
        ToolBox([untyped])
    with pytest.raises(ValueError, match=r"'varargs'.*\['xs'\]"):
        ToolBox([varargs])
    with pytest.raises(ValueError, match="two tools are named 'add'"):
        ToolBox([add, add])


# -- parse ------------------------------------------------------------------------------------------------------


def test_parse_single_and_multiple_calls(box):
    calls, errors = box.parse("Let me add.\n" + call("add", {"a": 1, "b": 2}))
    assert errors == []
    assert [(c.name, c.arguments) for c in calls] == [("add", {"a": 1, "b": 2})]
    assert isinstance(calls[0], ToolCall) and calls[0].id

    text = call("add", {"a": 1}) + "then\n" + call("lookup", {"key": "k"}) + "  \n" + call("add", {"a": 3})
    calls, errors = box.parse(text)
    assert errors == []
    assert [(c.name, c.arguments) for c in calls] == [("add", {"a": 1}), ("lookup", {"key": "k"}), ("add", {"a": 3})]
    assert len({c.id for c in calls}) == 3


def test_parse_tolerates_whitespace_and_arguments_as_string(box):
    text = '<tool_call>   \n\n {"name": "add", "arguments": "{\\"a\\": 5}"}  \n\t</tool_call>'
    calls, errors = box.parse(text)
    assert errors == [] and [(c.name, c.arguments) for c in calls] == [("add", {"a": 5})]


def test_parse_no_calls(box):
    assert box.parse("The answer is 42. </tool_call>") == ([], [])


@pytest.mark.parametrize("body, expected", [
    ('{"name": "add", "arguments": {"a": 1}', "not valid JSON"),
    ('{"arguments": {"a": 1}}', 'no "name"'),
    ('{"name": "", "arguments": {}}', 'no "name"'),
    ('{"name": "add"}', 'no "arguments"'),
    ('{"name": "add", "arguments": [1, 2]}', '"arguments" is not a JSON object'),
    ('{"name": "add", "arguments": "{oops"}', "string that is not valid JSON"),
    ('["add", {"a": 1}]', "not a JSON object"),
])
def test_parse_malformed_call(box, body, expected):
    calls, errors = box.parse(call("add", {"a": 1}) + f"<tool_call>{body}</tool_call>")
    assert [c.name for c in calls] == ["add"]  # the good call before it survives
    assert len(errors) == 1
    assert errors[0].startswith("error: tool call 2 ") and expected in errors[0]


def test_parse_unclosed_tag_is_malformed(box):
    calls, errors = box.parse(call("add", {"a": 1}) + '\n<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n')
    assert [c.arguments for c in calls] == [{"a": 1}]
    assert errors == ["error: tool call 2 has no closing </tool_call>"]


def test_parse_too_many_calls(box):
    text = "".join(call("add", {"a": i}) for i in range(5))  # max_calls=3
    calls, errors = box.parse(text)
    assert [c.arguments["a"] for c in calls] == [0, 1, 2]
    assert len(errors) == 2
    assert all("over the limit of 3" in e for e in errors)
    assert errors[0].startswith("error: tool call 4 ")


# -- run --------------------------------------------------------------------------------------------------------


def test_run_good_calls(box):
    res = run(box, call("add", {"a": 1.5, "b": 2}) + call("lookup", {"key": "k", "mode": "prefix"}))
    assert (res.calls, res.errors) == (2, 0)
    m0, m1 = res.messages
    assert m0["role"] == "tool" and m0["name"] == "add" and m0["content"] == "3.5"
    assert m0["tool_call_id"].startswith("call_") and m0["tool_call_id"] != m1["tool_call_id"]
    assert json.loads(m1["content"]) == {"key": "k", "mode": "prefix", "limit": None}
    assert run(box, call("nap", {"s": 0})).messages[0]["content"] == "awake"  # a str result is not re-quoted


def test_run_no_calls(box):
    assert run(box, "just an answer") == ToolResult(messages=[], calls=0, errors=0)


def test_run_unknown_tool(box):
    res = run(box, call("foo", {}))
    assert (res.calls, res.errors) == (1, 1)
    assert res.messages[0]["name"] == "foo"
    assert res.messages[0]["content"] == "error: unknown tool 'foo' (known: add, lookup, boom, nap, anap, a_set)"


def test_run_bad_arguments(box):
    res = run(box, call("add", {"b": 1}) + call("add", {"a": 1, "c": 2}))
    assert (res.calls, res.errors) == (2, 2)
    assert res.messages[0]["content"].startswith("error: bad arguments for 'add'")
    assert "'a'" in res.messages[0]["content"]
    assert "'c'" in res.messages[1]["content"]


def test_run_raising_tool_and_unserializable_result(box):
    res = run(box, call("boom", {"x": 7}) + call("a_set", {}))
    assert (res.calls, res.errors) == (2, 2)
    assert res.messages[0]["content"] == "error: tool 'boom' raised RuntimeError: kaput 7"
    assert res.messages[1]["content"].startswith("error: tool 'a_set' returned a result that is not JSON")


def test_run_sync_tool_timeout(box):
    t0 = time.monotonic()
    res = run(box, call("nap", {"s": 1.0}) + call("add", {"a": 1}))
    # asyncio.run joins the default executor at exit, so the nap's thread is waited for; the timeout itself
    # shows in the message and in the call after it still being run.
    assert time.monotonic() - t0 < 5
    assert (res.calls, res.errors) == (2, 1)
    assert res.messages[0]["content"] == "error: tool 'nap' timed out after 0.2 s"
    assert res.messages[1]["content"] == "1.0"


def test_run_sync_tool_timeout_does_not_block_the_loop(box):
    async def go():
        t0 = time.monotonic()
        res = await box.run(call("nap", {"s": 1.0}))
        return res, time.monotonic() - t0

    res, took = asyncio.run(go())
    assert res.messages[0]["content"].startswith("error: tool 'nap' timed out")
    assert took < 0.8  # run returned at the timeout, not when the thread finished


def test_run_async_tool_timeout(box):
    async def go():
        t0 = time.monotonic()
        fast = await box.run(call("anap", {"s": 0.01}))
        slow = await box.run(call("anap", {"s": 5}))
        return fast, slow, time.monotonic() - t0

    fast, slow, took = asyncio.run(go())
    assert fast.messages[0]["content"] == "awake" and fast.errors == 0
    assert slow.messages[0]["content"] == "error: tool 'anap' timed out after 0.2 s" and slow.errors == 1
    assert took < 2


@pytest.mark.parametrize("text", [
    "",
    "<tool_call>",
    "<tool_call></tool_call>",
    "<tool_call>null</tool_call>",
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
    '<tool_call>{"name": "add", "arguments": {"a": "x"}}</tool_call>',  # the tool raises TypeError
    '<tool_call>{"name": "add", "arguments": {"a": 1e999}}</tool_call>',  # inf: not strict JSON
    '<tool_call>{"name": "nap", "arguments": {"s": -1}}</tool_call>',  # time.sleep raises ValueError
    "</tool_call><tool_call><tool_call>{}</tool_call>",
    "\x00<tool_call>\ud800</tool_call>",
])
def test_run_never_raises(box, text):
    res = run(box, text)
    assert res.errors == len(res.messages) == (1 if "<tool_call>" in text else 0)
    assert all(m["role"] == "tool" and m["content"].startswith("error: ") for m in res.messages)
