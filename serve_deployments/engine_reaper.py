"""Ends a replica's vLLM engine processes when the replica's own process dies without ending them.

vLLM runs the engine core in a child process (`VLLM::EngineCore`) that does not watch its parent. When a
replica ends normally vLLM ends that child; when the replica's process is killed instead (its raylet died:
the core worker then leaves at once, with no Python cleanup; a driver that started the local cluster was
SIGKILLed; the OOM killer), the engine is reparented to init and keeps its memory, and on a GPU the whole
card, until someone finds it. Nothing inside the dead replica can act any more, so a small process of its own
(`python -m serve_deployments.engine_reaper`, ~15 MB) waits for the replica to go and then ends the engine
processes it was given: SIGTERM (vLLM's own handler shuts the engine down and ends its workers), SIGKILL what is
left after a grace. It leaves as soon as the engine processes are gone, so a replica that ends normally leaves
nothing behind either. A process is named by PID and start time, so a reused PID is never touched.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

POLL_S = 1.0
GRACE_S = 10.0


def _key(p: psutil.Process) -> str:
    return f"{p.pid}:{p.create_time()!r}"


def _alive(key: str) -> psutil.Process | None:
    pid, _, created = key.partition(":")
    try:
        p = psutil.Process(int(pid))
        if repr(p.create_time()) == created and p.status() != psutil.STATUS_ZOMBIE:
            return p
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        pass
    return None


def children() -> set[int]:
    """The PIDs of this process's children now."""
    try:
        return {c.pid for c in psutil.Process().children()}
    except psutil.Error:
        return set()


def _engine_processes(before: set[int]) -> list[str]:
    """The children started since `before`, with their own descendants (an engine core's workers), but not
    multiprocessing's resource tracker: that one ends by itself when its owner goes (it reads a pipe to EOF) and
    lives as long as the owner otherwise, so watching it would keep the reaper for the owner's whole life. Only
    direct children: a Ray node started in this process (tests, a local cluster) spawns workers meanwhile, and
    they are not the engine's."""
    keys = []
    for pid in children() - before:
        try:
            p = psutil.Process(pid)
            if "resource_tracker" in " ".join(p.cmdline()):
                continue
            keys += [_key(q) for q in [p, *p.children(recursive=True)]]
        except psutil.Error:
            pass
    return keys


def watch(before: set[int]) -> subprocess.Popen | None:
    """Starts the reaper over the processes this process started since `before` (the engine's, when `before`
    was taken just ahead of building it); None when there are none (an in-process engine)."""
    procs = _engine_processes(before)
    if not procs:
        return None
    # Its own session: a signal for the replica's process group must not end the reaper before the replica.
    return subprocess.Popen([sys.executable, "-m", __name__.rpartition(".")[0] + ".engine_reaper",
                             _key(psutil.Process()), *procs],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,  # stderr: the replica's log
                            start_new_session=True, close_fds=True)


def reap(owner: str, targets: list[str], poll_s: float = POLL_S, grace_s: float = GRACE_S) -> list[int]:
    """Waits until `owner` is gone, then ends the `targets` still running; returns their PIDs. Returns [] at
    once when the targets end first (the owner ended its engine itself)."""
    while True:
        left = [p for p in (_alive(t) for t in targets) if p is not None]
        if not left:
            return []
        if _alive(owner) is None:
            break
        time.sleep(poll_s)
    for p in left:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, still = psutil.wait_procs(left, timeout=grace_s)
    for p in still:
        try:
            p.kill()
        except psutil.Error:
            pass
    return [p.pid for p in left]


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m serve_deployments.engine_reaper OWNER_PID:START PID:START ...", file=sys.stderr)
        return 2
    ended = reap(argv[0], argv[1:])
    if ended:
        print(f"engine_reaper: the replica process {argv[0].partition(':')[0]} is gone; ended its engine "
              f"processes {ended}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.nice(5)  # a watcher: never in the way of the engine it watches
    sys.exit(main(sys.argv[1:]))
