"""The driver's train-failure budget (app/watch.py `Progress._check_restarts`): Ray Train restarts the worker group
without limit for the driver's runs, and the watch ends a run whose group restarted more than train.max_restarts
times with no step logged between (a crash that comes back every time); a logged step refills the budget. The
buffer's `trainer_starts` counts the group's starts (rank 0 counts each start before loading anything). Without Ray: the
rule itself; the restart path with real Ray Train is in tests/test_e2e.py (a train worker SIGKILLed mid-run) and
`python -m app bench chaos`."""
from __future__ import annotations

import pytest

from app.watch import Progress, RestartsError, StallError
from common import config as C


def _progress(max_restarts: int = 3) -> Progress:
    cfg = C.load("recipes/tiny-cpu.yaml", [f"train.max_restarts={max_restarts}"])
    return Progress(cfg, metrics=None, ingress=None, buffer=None, registry=None, enabled=False)


def test_restarts_before_the_first_step_count_from_the_first_start():
    p = _progress(2)
    p._check_restarts({"trainer_starts": 1})  # the first start is no restart
    p._check_restarts({"trainer_starts": 3})  # two restarts: at the limit
    with pytest.raises(RestartsError, match=r"restarted 3 times without logging a step \(train.max_restarts=2\)"):
        p._check_restarts({"trainer_starts": 4})


def test_a_logged_step_refills_the_budget():
    p = _progress(1)
    p._starts_at_step = 5  # four restarts so far, each followed by steps
    p._check_restarts({"trainer_starts": 6})
    with pytest.raises(RestartsError) as e:
        p._check_restarts({"trainer_starts": 7})
    assert isinstance(e.value, StallError) and "--resume" in str(e.value)  # exit 1 and the way on, like a stall


def test_zero_allows_no_restart_and_negative_is_refused():
    p = _progress(0)
    p._check_restarts({"trainer_starts": 1})
    with pytest.raises(RestartsError, match=r"restarted once without logging a step \(train.max_restarts=0\)"):
        p._check_restarts({"trainer_starts": 2})
    with pytest.raises(C.ConfigError, match="train.max_restarts"):
        C.load("recipes/tiny-cpu.yaml", ["train.max_restarts=-1"])


def test_a_rollout_worker_restarting_without_steps_ends_the_run():
    """Ray restarts a killed rollout worker without limit (app/rollout_worker.py); the buffer counts each
    incarnation (`reset_worker`) and the watch bounds them like the train group's."""
    cfg = C.load("recipes/tiny-cpu.yaml", ["rollout.max_restarts=2"])
    p = Progress(cfg, metrics=None, ingress=None, buffer=None, registry=None, enabled=False)
    p._check_restarts({"trainer_starts": 1, "rollout_starts": {"0": 1, "1": 3}})  # worker 1: two restarts
    with pytest.raises(RestartsError, match=r"rollout worker 1 restarted 3 times without logging a step "
                                            r"\(rollout.max_restarts=2\)"):
        p._check_restarts({"trainer_starts": 1, "rollout_starts": {"0": 1, "1": 4}})
    p._worker_starts_at_step = {"0": 1, "1": 9}  # eight restarts spread over steps: the budget refilled
    p._check_restarts({"trainer_starts": 1, "rollout_starts": {"0": 3, "1": 11}})
    with pytest.raises(C.ConfigError, match="rollout.max_restarts"):
        C.load("recipes/tiny-cpu.yaml", ["rollout.max_restarts=-1"])
