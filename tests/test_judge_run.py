"""A short real run with a judge reward: the letters task, the run's own replica as the judge (its base
weights, version 0, through the run's own ingress), real Ray, Serve, vLLM and DeepSpeed."""
from __future__ import annotations

import json

import pytest

from tests._serve_helpers import serve_env  # noqa: F401

pytestmark = pytest.mark.slow


def test_a_run_judged_by_its_own_replicas_logs_judge_metrics(serve_env, tmp_path):  # noqa: F811
    from app import driver
    from common import config as C

    cfg = C.load("recipes/judge-cpu.yaml", [
        f"model.path={serve_env.model_dir}", "model.build_tiny=false", f"run.out_dir={tmp_path}", "run.name=judged",
        "train.total_steps=2", "train.num_workers=1", "train.cpus_per_worker=0.5", "rollout.replicas=1",
        "rollout.cpus_per_replica=0.5", "rollout.workers=1", "grpo.prompts_per_step=4", "grpo.group_size=4",
        "checkpoint.every=0", "eval.path=null", f"rollout.http_port={serve_env.http_port}",
        "run.stall_timeout_s=300"])
    summary = driver.run(cfg, progress=False)
    assert summary["steps"] == 2
    rows = [json.loads(line) for line in (tmp_path / "judged" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    last = rows[-1]
    # every sample of every group was judged, each call answered by the service (no error, no timeout)
    assert last["judge_calls"] >= 2 * 4 * 4
    assert last["judge_errors"] == 0 and last["judge_timeouts"] == 0
    assert 0 <= last["judge_parse_failures"] <= last["judge_calls"]
    assert any(r["judge_seconds"] > 0 for r in rows)
    judged = [r["reward_judge"] for r in rows if r["reward_judge"] is not None]
    assert judged and all(0.0 <= score <= 1.0 for score in judged)
