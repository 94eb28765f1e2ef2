"""A test's own processes, found by descent from one it started: what is left of them after a kill."""
from __future__ import annotations

import time

import psutil


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def is_engine(p: psutil.Process) -> bool:
    """A vLLM engine core process (its title is `VLLM::EngineCore`)."""
    try:
        return "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline())
    except psutil.Error:
        return False


def _running(p: psutil.Process) -> bool:
    """Running and not a zombie waiting for its parent (one that ended, reparented to init, is reaped soon)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def left_after(procs: list[psutil.Process], wait_s: float) -> list[str]:
    """Waits up to `wait_s` for `procs` to end on their own, then ends the ones still running (they are the
    test's own) and names them: an empty list means all ended by themselves."""
    deadline = time.monotonic() + wait_s
    alive = [p for p in procs if _running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.5)
        alive = [p for p in alive if _running(p)]
    named = []
    for p in alive:
        try:
            named.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
            p.kill()
        except psutil.Error:
            pass
    return named
