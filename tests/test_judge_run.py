"""A short real run with a judge reward and the trainer's behaviour logprobs (one run for both: each whole run
costs about a minute of starts on 2 cores), real Ray, Serve, vLLM, DeepSpeed (2 ranks) and PEFT:
- the judge: the letters task, the run's own replica as the judge (its base weights, version 0, through the run's
  own ingress); every sample judged, the judge's metrics logged;
- `rollout.behaviour_logprobs: trainer`: the engine samples most groups without logprobs, the trainer scores them
  (the training forward for its current version, the pre-pass under a kept older version with max_staleness 1),
  every few groups still carry vLLM's logprobs and the trainer/vLLM agreement is reported on them."""
from __future__ import annotations

import json
import math

import pytest

from tests._serve_helpers import serve_env  # noqa: F401

pytestmark = pytest.mark.slow

STEPS, PER_STEP, GROUP = 4, 4, 4


def test_a_judged_run_with_trainer_behaviour_logprobs(serve_env, tmp_path):  # noqa: F811
    from app import driver
    from common import config as C

    cfg = C.load("recipes/judge-cpu.yaml", [
        f"model.path={serve_env.model_dir}", "model.build_tiny=false", f"run.out_dir={tmp_path}", "run.name=judged",
        f"train.total_steps={STEPS}", "rollout.replicas=1", "rollout.workers=2", f"grpo.prompts_per_step={PER_STEP}",
        f"grpo.group_size={GROUP}", "sync.max_staleness=1", "checkpoint.every=0", "eval.path=null",
        "rollout.behaviour_logprobs=trainer", "rollout.engine_logprobs_every=3",
        f"rollout.http_port={serve_env.http_port}", "run.stall_timeout_s=300"])
    summary = driver.run(cfg, progress=False)
    assert summary["steps"] == STEPS
    rows = [json.loads(line) for line in (tmp_path / "judged" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))

    # the judge: every sample of every group judged, each call answered by the service (no error, no timeout)
    last = rows[-1]
    assert last["judge_calls"] >= STEPS * PER_STEP * GROUP
    assert last["judge_errors"] == 0 and last["judge_timeouts"] == 0
    assert 0 <= last["judge_parse_failures"] <= last["judge_calls"]
    assert any(r["judge_seconds"] > 0 for r in rows)
    judged = [r["reward_judge"] for r in rows if r["reward_judge"] is not None]
    assert judged and all(0.0 <= score <= 1.0 for score in judged)

    # the trainer's behaviour logprobs
    samples = PER_STEP * GROUP
    for r in rows:  # a NaN left in the behaviour logprobs would reach all of these
        assert all(math.isfinite(r[k]) for k in ("loss", "grad_norm", "log_ratio_abs_mean", "entropy")), r
        assert r["behaviour_unscored_samples"] == 0
        assert 0 < r["behaviour_trainer_samples"] <= samples and r["behaviour_prepass_seconds"] >= 0
    # the engine's own logprobs on the every-3rd groups (each worker's first included): the agreement metric
    agreement = [r["log_ratio_fresh"] for r in rows if "log_ratio_fresh" in r]
    assert agreement and all(0 <= a < 1e-3 for a in agreement), agreement
    assert sum(r["behaviour_trainer_samples"] for r in rows) < samples * STEPS  # some groups kept the engine's
    # max_staleness 1: some samples came from the version before the trainer's, scored under its kept weights
    assert any(r["behaviour_prepass_samples"] > 0 for r in rows), [
        {k: r.get(k) for k in ("step", "staleness_mean", "behaviour_trainer_samples", "behaviour_prepass_samples")}
        for r in rows]
