"""serve_deployments/engine_reaper.py with real processes: an "engine" that outlives its "replica" is ended once
the replica is killed; one that ends first (or a reused PID) is left alone. The vLLM case itself (a driver
SIGKILLed with its local cluster) is asserted in tests/test_resume.py and tests/test_unplaceable.py."""
import contextlib
import subprocess
import sys
import time

import psutil
import pytest

from serve_deployments import engine_reaper

# A "replica": starts an "engine" child (its own session, as vLLM's survives its parent) and prints its PID.
OWNER = """
import subprocess, sys, time
c = subprocess.Popen([sys.executable, "-c", {engine!r}], start_new_session=True)
print(c.pid, flush=True)
time.sleep(300)
"""
ENGINE = "import time; time.sleep(300)"
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"


def _owner_and_engine(engine: str):
    owner = subprocess.Popen([sys.executable, "-c", OWNER.format(engine=engine)], stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(owner.stdout.readline()))
    return owner, child


@contextlib.contextmanager
def owner_and_engine(engine: str):
    """The pair, both ended afterwards whatever the test did to them."""
    owner, child = _owner_and_engine(engine)
    try:
        yield owner, child
    finally:
        for p in (owner, child):
            try:
                p.kill()
            except (psutil.Error, ProcessLookupError):
                pass


def test_engine_is_ended_after_its_owner_is_killed():
    with owner_and_engine(ENGINE) as (owner, child):
        reaper = subprocess.Popen([sys.executable, "-m", "serve_deployments.engine_reaper",
                                   engine_reaper._key(psutil.Process(owner.pid)), engine_reaper._key(child)],
                                  stderr=subprocess.PIPE, text=True)
        time.sleep(2)
        assert reaper.poll() is None and child.is_running()  # the owner lives: nothing happens
        owner.kill()
        owner.wait()
        _, err = reaper.communicate(timeout=30)
        assert reaper.returncode == 0
        assert f"ended its engine processes [{child.pid}]" in err
        child.wait(timeout=5)
        assert not child.is_running()


def test_engine_that_ignores_sigterm_is_killed_after_the_grace():
    with owner_and_engine(STUBBORN) as (owner, child):
        time.sleep(1)  # the child's SIGTERM handler is set
        owner.kill()
        owner.wait()
        t0 = time.monotonic()
        assert engine_reaper.reap(f"{owner.pid}:0.0", [engine_reaper._key(child)], poll_s=0.1, grace_s=1) == [child.pid]
        assert time.monotonic() - t0 < 5
        child.wait(timeout=5)
        assert not child.is_running()


def test_reaper_leaves_when_the_engine_ends_first_and_never_touches_a_reused_pid():
    owner, child = _owner_and_engine(ENGINE)
    try:
        t0 = time.monotonic()
        key = engine_reaper._key(child)
        child.kill()
        assert engine_reaper.reap(engine_reaper._key(psutil.Process(owner.pid)), [key], poll_s=0.1) == []
        assert time.monotonic() - t0 < 5
        # a PID whose start time differs is another process: never a target
        other, other_child = _owner_and_engine(ENGINE)
        wrong = f"{other_child.pid}:{other_child.create_time() + 1!r}"
        assert engine_reaper.reap(f"{owner.pid}:0.0", [wrong], poll_s=0.1) == []
        assert other_child.is_running()
        for p in (other, other_child):
            p.kill()
    finally:
        owner.kill()


def test_watch_names_only_new_children_and_not_the_resource_tracker():
    before = engine_reaper.children()
    assert engine_reaper.watch(before) is None  # nothing new: no reaper (an in-process engine)
    tracker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300) # resource_tracker"])
    engine = subprocess.Popen([sys.executable, "-c", ENGINE])
    try:
        time.sleep(0.5)
        reaper = engine_reaper.watch(before)
        assert reaper is not None
        args = psutil.Process(reaper.pid).cmdline()
        assert args[-1] == engine_reaper._key(psutil.Process(engine.pid)) and len(args) == 5  # py -m mod owner t
        assert args[-2] == engine_reaper._key(psutil.Process())
        engine.kill()
        engine.wait()
        assert reaper.wait(timeout=10) == 0  # its engine gone, the reaper leaves too (the tracker lives on)
        assert tracker.poll() is None
    finally:
        for p in (engine, tracker):
            p.kill()
            p.wait()
