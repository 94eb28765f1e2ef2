"""A GPU sitting's work as a queue, so that one device call after another runs the next items with nothing
decided between them (a lent machine goes back 30 s after a call ends; calls sent together in one batch run back
to back):

    bash benchmarks/gpu_lease.sh run python3 -m benchmarks.gpu_queue benchmarks/gpu_queue.txt --budget-s 540

QUEUE holds one item per line, `NAME SECONDS COMMAND...` (a line starting with `#` is a comment), in the order they
matter. A call runs, in order, each item not yet run whose SECONDS fit in what is left of its --budget-s, each with
SECONDS as its limit (its process group ended there), and stops at the first that does not fit: that item opens the
next call. An item longer than a whole call is skipped and said so. What each item did (exit code, seconds, the tail
of its output) goes to STATE (default /tmp/gpout/queue_state.json, which outlives a call while the machine stays
warm), its whole output to /tmp/gpout/NAME.log."""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class Item:
    name: str
    seconds: int
    command: str


def parse_queue(text: str) -> list[Item]:
    """The queue's items; ValueError naming the line for a malformed one or a name used twice."""
    items, seen = [], set()
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(None, 2)
        if len(parts) < 3 or not NAME.match(parts[0]) or not parts[1].isdigit() or int(parts[1]) <= 0:
            raise ValueError(f"queue line {n}: expected NAME SECONDS COMMAND (NAME of letters, digits, '.', '_', "
                             f"'-'; SECONDS > 0), got {raw.strip()!r}")
        if parts[0] in seen:
            raise ValueError(f"queue line {n}: {parts[0]!r} is named twice")
        seen.add(parts[0])
        items.append(Item(parts[0], int(parts[1]), parts[2]))
    return items


def plan_call(items: list[Item], done: set[str], budget_s: float) -> tuple[list[Item], list[Item]]:
    """(the items this call runs, in order; the items skipped as longer than any call). Items run in queue
    order: the first pending item that does not fit in what is left ends the call's share."""
    run, skipped, left = [], [], budget_s
    for item in items:
        if item.name in done:
            continue
        if item.seconds > budget_s:
            skipped.append(item)
            continue
        if item.seconds > left:
            break
        run.append(item)
        left -= item.seconds
    return run, skipped


def run_item(item: Item, log: Path) -> dict:
    """The item's command under bash in its own process group, ended (the whole group) at item.seconds."""
    t0 = time.time()
    with log.open("w") as out:
        p = subprocess.Popen(["bash", "-c", item.command], stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            rc = p.wait(timeout=item.seconds)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            rc = "timeout"
        else:
            try:  # whatever it left behind in its group (a Ray cluster's raylet, say)
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    tail = log.read_text(errors="replace")[-1500:]
    return {"rc": rc, "seconds": round(time.time() - t0, 1), "command": item.command, "tail": tail}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("queue")
    p.add_argument("--budget-s", type=float, default=540.0, help="seconds this call may spend on items")
    p.add_argument("--state", default="/tmp/gpout/queue_state.json")
    p.add_argument("--logs", default="/tmp/gpout")
    p.add_argument("--dry-run", action="store_true", help="say what this call would run, run nothing")
    args = p.parse_args(argv)
    try:
        items = parse_queue(Path(args.queue).read_text())
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    state_file = Path(args.state)
    state = json.loads(state_file.read_text()) if state_file.is_file() else {}
    run, skipped = plan_call(items, set(state), args.budget_s)
    for item in skipped:
        print(f"queue: {item.name} skipped: {item.seconds} s is longer than a call ({args.budget_s:g} s)", flush=True)
    pending = [i.name for i in items if i.name not in state and i not in run and i not in skipped]
    print(f"queue: this call runs {[i.name for i in run] or 'nothing'}; after it: {pending or 'nothing'}", flush=True)
    if args.dry_run:
        return 0
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    state_file.parent.mkdir(parents=True, exist_ok=True)
    for item in run:
        print(f"queue: {item.name} (up to {item.seconds} s): {shlex.split(item.command)[:6]}", flush=True)
        state[item.name] = run_item(item, Path(args.logs) / f"{item.name}.log")
        state_file.write_text(json.dumps(state, indent=1))
        print(f"queue: {item.name} rc={state[item.name]['rc']} in {state[item.name]['seconds']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
