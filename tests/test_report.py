"""`python -m app report RUN_DIR` on a finished run and on a failed one (truncated metrics.jsonl, no
summary.json): exit 0, PNGs written, a summary with the step count. No Ray."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from app import report as R

REPO = Path(__file__).resolve().parent.parent


def _row(step: int, t0: float = 1_700_000_000.0) -> dict:
    row = {"step": step, "time": t0 + 3.0 * step, "version": step, "loss": 0.1, "kl": 0.001 * step,
           "log_ratio_abs_mean": 0.01, "reward_mean": min(1.0, 0.3 + 0.02 * step), "reward_std": 0.2,
           "staleness_mean": 1.0, "staleness_max": 2, "dropped_samples": step // 10, "publish_seconds": 0.05,
           "published": 1, "train_tokens_per_s": 900.0, "gen_tokens_per_s": 400.0, "step_seconds": 3.0,
           "batch_wait_seconds": 0.6, "gen_seconds_sum": 4.0, "gen_groups": 8, "vllm_prefix_hit_rate": 0.8}
    if step % 5 == 0:
        row["eval/accuracy"] = 0.25 + 0.01 * step
    return row


def _run_dir(tmp_path: Path, steps: int, finished: bool) -> Path:
    d = tmp_path / ("done" if finished else "failed")
    d.mkdir()
    (d / "config.yaml").write_text(yaml.safe_dump({"run": {"name": d.name, "mode": "async"},
                                                   "train": {"total_steps": 40}, "rollout": {"workers": 2}}))
    lines = [json.dumps(_row(s)) for s in range(1, steps + 1)]
    if finished:
        (d / "summary.json").write_text(
            json.dumps({"steps": steps, "wall_seconds": 120.0, "adapter_dir": str(d / "adapter")})
        )
        text = "\n".join(lines) + "\n"
    else:
        text = "\n".join(lines) + "\n" + json.dumps(_row(steps + 1))[:37]  # killed mid-write
    (d / "metrics.jsonl").write_text(text)
    if not finished:  # died an hour ago
        os.utime(d / "metrics.jsonl", (os.path.getmtime(d / "metrics.jsonl") - 3600,) * 2)
    return d


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "app", "report", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def test_report_on_finished_and_failed_runs(tmp_path):
    done, failed = _run_dir(tmp_path, 40, True), _run_dir(tmp_path, 13, False)
    for d, steps, state in ((done, 40, "finished"), (failed, 13, "failed or killed")):
        for png in ("report.png", "reward_curve.png"):
            (d / png).unlink(missing_ok=True)
        p = _cli(d)
        assert p.returncode == 0, p.stderr
        out = p.stdout
        assert f"steps: {steps} (last step {steps} of 40)" in out, out
        assert state in out and "eval/accuracy" in out and "reward:" in out
        assert (d / "report.png").stat().st_size > 10_000 and (d / "reward_curve.png").stat().st_size > 10_000
        assert len(out.splitlines()) <= 25  # one screen
    (failed / "metrics.jsonl").touch()  # written just now: a run in progress
    out = _cli(failed, "--no-plots").stdout
    assert "1 unreadable line(s)" in out and "still running" in out and "plots: none" in out


def test_report_panels_follow_the_keys_present(tmp_path):
    rows = [_row(s) for s in range(1, 11)]
    titles = [t for t, _, _ in R._panels(rows, workers=2)]
    assert titles == ["reward and eval", "KL and trainer/vLLM log ratio", "staleness and dropped samples",
                      "sync latency", "throughput", "idle fractions"]
    only_reward = [{"step": s, "reward_mean": 0.5} for s in range(1, 4)]
    assert [t for t, _, _ in R._panels(only_reward, workers=None)] == ["reward and eval"]
    assert R.plot_report(only_reward, tmp_path / "r.png").is_file()
    assert R.trainer_idle(rows)[0] == (1, pytest.approx(0.2))
    assert R.generation_idle(rows, 2)[0][1] == 1.0 - 4.0 / (2 * 3.0)


def test_report_without_steps_and_missing_dir(tmp_path):
    (tmp_path / "early").mkdir()
    p = _cli(tmp_path / "early")
    assert p.returncode == 0 and "steps: 0" in p.stdout and "no steps logged" in p.stdout
    p = _cli(tmp_path / "nope")
    assert p.returncode == 2 and "no such run directory" in p.stderr


def test_an_eval_is_drawn_at_the_step_whose_policy_it_scored():
    # An eval runs beside training: the score of step 10's policy lands in step 30's row.
    rows = [{"step": s, "reward_mean": 0.5} for s in range(1, 41)]
    rows[29].update({"eval/accuracy": 0.25, "eval/step": 10, "eval/version": 10})
    rows[39].update({"eval/accuracy": 0.5})  # a row without eval/step (older metrics files) keeps its own step
    reward_panel = R._panels(rows, workers=None)[0]
    curves = {label: pts for label, pts, _ in reward_panel[2]}
    assert curves["eval/accuracy"] == [(10, 0.25), (40, 0.5)]
