"""benchmarks/gpu_serve_check.py's judgement of a tool call, on recorded response bodies: the script itself needs a
GPU (its PEFT reference runs on CUDA), so CI checks the part that decides `ok` (a name shadowed in its loop once
ended a GPU run after the whole service had been checked)."""
import json

from benchmarks.gpu_serve_check import tool_call_check


def _body(name: str, arguments: dict | str) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"choices": [{"message": {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-0", "type": "function", "function": {"name": name, "arguments": args}}]}}]}


def test_one_call_inside_the_schema_is_ok():
    rec = tool_call_check(200, _body("set_unit", {"unit": "c", "n": 3}))
    assert rec == {"status": 200, "names": ["set_unit"], "arguments": {"unit": "c", "n": 3}, "ok": True}


def test_arguments_outside_the_schema_a_wrong_name_or_an_error_are_not():
    assert not tool_call_check(200, _body("set_unit", {"unit": "k", "n": 3}))["ok"]
    assert not tool_call_check(200, _body("set_unit", {"unit": "f", "n": 10}))["ok"]
    assert not tool_call_check(200, _body("other", {"unit": "f", "n": 1}))["ok"]
    no_call = {"choices": [{"message": {"role": "assistant", "content": "hi", "tool_calls": None}}]}
    assert tool_call_check(200, no_call) == {"status": 200, "names": [], "arguments": {}, "ok": False}
    assert tool_call_check(400, None) == {"status": 400, "names": [], "arguments": {}, "ok": False}
