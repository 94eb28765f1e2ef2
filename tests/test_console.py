"""The console of `python -m app train`: quiet by default. A short real run of the tiny recipe
prints at most 60 lines (a progress bar updating in place with \\r counts once), shows the start lines,
summary lines and the final summary, and the engines' logs land in RUN_DIR/logs/."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def test_short_run_prints_at_most_60_lines(tmp_path, tiny_model_dir):
    from tests._serve_helpers import free_port

    env = dict(os.environ, TERM="dumb", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "app", "train", "--config", "recipes/tiny-cpu.yaml",
         "--set", f"model.path={tiny_model_dir}", "--set", "model.build_tiny=false",
         "--set", "train.total_steps=4", "--set", "run.log_every=2", "--set", "eval.every=2",
         "--set", "rollout.replicas=1", "--set", "train.num_workers=1",  # the console, not the cluster, is tested
         "--set", "eval.samples=16", "--set", "checkpoint.every=0", "--set", f"run.out_dir={tmp_path}",
         "--set", f"rollout.http_port={free_port()}"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:]
    lines = out.count("\n") + (not out.endswith("\n"))
    assert lines <= 60, f"{lines} lines:\n{out}"
    assert "service:" in out and "trainer:" in out and "done: 4 steps" in out, out
    assert "step 2/4 | reward" in out and "eval acc" in out, out  # run.log_every summary lines, with eval
    assert "eval: accuracy" in out, out
    assert "CALL generate" not in out and "ServeReplica" not in out, out  # engines' lines stay in files
    logs = tmp_path / "tiny-cpu" / "logs"
    assert (logs / "driver.log").is_file() and (logs / "ray").is_dir(), sorted(p.name for p in logs.iterdir())
    assert any((logs / "ray").glob("worker-*")), "Ray's worker logs are not reachable from RUN_DIR/logs/ray"
