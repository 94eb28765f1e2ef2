"""benchmarks/gpu_queue.py: a GPU sitting's queue (parsing, what each call runs, limits that end the item's whole
process group). Real processes; nothing here needs a GPU."""
from __future__ import annotations

import json
import os
import time

import pytest

from benchmarks.gpu_queue import Item, main, parse_queue, plan_call, run_item


def test_parse_reads_items_and_names_a_bad_line():
    items = parse_queue("# a comment\n\na 10 echo 'x # not a comment'\nb 20 sleep 1\n")
    assert items == [Item("a", 10, "echo 'x # not a comment'"), Item("b", 20, "sleep 1")]
    with pytest.raises(ValueError, match="queue line 2: expected NAME SECONDS COMMAND"):
        parse_queue("a 10 true\nb ten true\n")
    with pytest.raises(ValueError, match="queue line 2: 'a' is named twice"):
        parse_queue("a 10 true\na 5 false\n")


def test_a_call_runs_items_in_order_until_one_does_not_fit():
    items = [Item("a", 300, "x"), Item("b", 200, "x"), Item("c", 100, "x"), Item("huge", 900, "x"),
             Item("d", 50, "x")]
    run, skipped = plan_call(items, set(), 540)
    assert [i.name for i in run] == ["a", "b"] and [i.name for i in skipped] == []  # c waits: order kept
    run, skipped = plan_call(items, {"a", "b"}, 540)
    assert [i.name for i in run] == ["c", "d"] and [i.name for i in skipped] == ["huge"]


def test_an_item_past_its_limit_ends_with_its_whole_group(tmp_path):
    pid_file = tmp_path / "child.pid"
    t0 = time.monotonic()
    out = run_item(Item("slow", 2, f"sleep 60 & echo $! > {pid_file}; echo started; wait"), tmp_path / "slow.log")
    assert out["rc"] == "timeout" and time.monotonic() - t0 < 20 and "started" in out["tail"]
    child = int(pid_file.read_text())
    for _ in range(50):  # the background sleep went with its group
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the item's background child {child} outlived its limit")


def test_two_calls_share_a_queue_through_the_state(tmp_path, capsys):
    q = tmp_path / "q.txt"
    q.write_text("one 5 echo first\ntwo 5 exit 3\nthree 5 echo third\n")
    state = tmp_path / "state.json"
    args = [str(q), "--state", str(state), "--logs", str(tmp_path)]
    assert main([*args, "--budget-s", "10"]) == 0
    done = json.loads(state.read_text())
    assert set(done) == {"one", "two"} and done["one"]["rc"] == 0 and done["two"]["rc"] == 3
    assert (tmp_path / "one.log").read_text() == "first\n"
    assert main([*args, "--budget-s", "10"]) == 0
    assert json.loads(state.read_text())["three"]["rc"] == 0
    assert main([*args, "--budget-s", "10"]) == 0 and "this call runs nothing" in capsys.readouterr().out
    q.write_text("a 5 true\nb x true\n")
    assert main([str(q), "--state", str(tmp_path / "s2.json")]) == 2
