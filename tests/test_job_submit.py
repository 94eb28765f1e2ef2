"""The user's path: `ray start --head`, then `ray job submit --working-dir . -- python -m app train ...`.
While the job runs, its Serve application and its metrics are visible through the dashboard's REST
API and the node's Prometheus endpoint (what the dashboard's Metrics view reads); the job succeeds.
The job runs in sync mode (`run.mode=sync`: each step samples under the version just published), so this
test is also the end-to-end check of that mode; one replica and one train worker, since the submission path,
not the cluster's size, is what is tested here.

The job's log (the driver's console, as the dashboard's job page shows it) is also the console's test: quiet by
default, at most 60 lines for a short run (a progress bar updating in place with \\r counts once), with the start
lines, the summary lines (run.log_every), the eval and the final summary, and the engines' logs in RUN_DIR/logs/.

The cluster is started by this test as `ray start --head --block` in a child process, so terminating
that process stops exactly this cluster (never `ray stop`, which would stop every Ray on the machine).
"""
import os
import re
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from app.report import read_rows
from common.processes import end_process
from tests._serve_helpers import free_port

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent


TOKEN = secrets.token_hex(32)  # this cluster's own auth token (Ray 2.60 token auth), not ~/.ray's


def _get(url: str):
    try:
        return httpx.get(url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    except httpx.HTTPError:
        return None


def _submit(cmd: list[str], env: dict, wait_s: float = 180) -> subprocess.CompletedProcess:
    """`ray job submit`, again while the node's agent has not registered yet: the dashboard answers
    /api/version before the agent that runs jobs is up (a loaded CI machine: "No available agent to
    submit job, please try again later"), as a user retrying by hand would."""
    deadline = time.monotonic() + wait_s
    while True:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        if r.returncode == 0 or "No available agent" not in r.stderr or time.monotonic() > deadline:
            return r
        time.sleep(3)


def test_job_submit_serves_and_exports_metrics(tiny_model_dir, tmp_path):
    ray_bin = str(Path(sys.executable).parent / "ray")
    gcs, dash, prom, http = free_port(), free_port(), free_port(), free_port()
    token_file = tmp_path / "auth_token"
    token_file.write_text(TOKEN)
    env = dict(os.environ, RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S="600", TOKENIZERS_PARALLELISM="false",
               RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_file),
               # as after `. .venv/bin/activate`: the job's `python` is this interpreter, not the system's
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    head = subprocess.Popen(
        [ray_bin, "start", "--head", "--block", f"--port={gcs}", "--num-cpus=2", "--include-dashboard=true",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--metrics-export-port={prom}",
         "--disable-usage-stats"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    api = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.monotonic() + 180
        while (r := _get(f"{api}/api/version")) is None or r.status_code != 200:
            assert head.poll() is None, "ray start --head exited"
            assert time.monotonic() < deadline, "dashboard did not come up"
            time.sleep(2)
        out = tmp_path / "runs"
        submit = _submit(
            [ray_bin, "job", "submit", "--address", api, "--working-dir", str(REPO), "--no-wait", "--",
             "python", "-m", "app", "train", "--config", "recipes/tiny-cpu.yaml",
             "--set", f"model.path={tiny_model_dir}", "--set", "model.build_tiny=false",
             "--set", f"run.out_dir={out}", "--set", "run.name=job", "--set", "train.total_steps=4",
             "--set", f"rollout.http_port={http}", "--set", "checkpoint.every=0", "--set", "run.mode=sync",
             "--set", "rollout.replicas=1", "--set", "train.num_workers=1", "--set", "rollout.workers=1",
             "--set", "run.log_every=2", "--set", "eval.every=2", "--set", "eval.samples=16"],
            env=env)
        assert submit.returncode == 0, submit.stdout + submit.stderr
        job_id = re.search(r"raysubmit_[A-Za-z0-9]+", submit.stdout).group(0)

        seen_app = seen_metric = False
        status = None
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            status = _get(f"{api}/api/jobs/{job_id}").json()["status"]
            if not seen_app and (r := _get(f"{api}/api/serve/applications/")) is not None and r.status_code == 200:
                apps = r.json().get("applications", {})
                seen_app = apps.get("policy", {}).get("status") == "RUNNING"
            if not seen_metric and (r := _get(f"http://127.0.0.1:{prom}/metrics")) is not None:
                seen_metric = "lora_grpo_reward_mean" in r.text
            if status in ("SUCCEEDED", "FAILED", "STOPPED"):
                break
            time.sleep(3)
        logs = _get(f"{api}/api/jobs/{job_id}/logs")
        console = logs.json().get("logs", "") if logs is not None else ""
        assert status == "SUCCEEDED", f"job {job_id} ended {status}:\n{console[-3000:]}"
        assert seen_app, "the job's Serve application 'policy' never showed RUNNING in /api/serve/applications/"
        assert seen_metric, "no lora_grpo_* metric on the node's Prometheus endpoint"
        assert (out / "job" / "summary.json").exists()
        rows = read_rows(out / "job" / "metrics.jsonl")[0]
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
        # sync: every sample of step N was generated by version N-1, the one the trainer just published
        assert [r["staleness_max"] for r in rows] == [0, 0, 0, 0], [r.get("staleness_max") for r in rows]

        # the console: short, the lines a user reads, the engines' chatter in files
        lines = console.count("\n") + (not console.endswith("\n"))
        assert lines <= 60, f"{lines} lines:\n{console}"
        assert "service:" in console and "trainer:" in console and "done: 4 steps" in console, console
        assert "step 2/4 | reward" in console and "eval acc" in console, console  # run.log_every lines
        assert "eval: accuracy" in console, console
        assert "CALL generate" not in console and "ServeReplica" not in console, console
        # every line of the driver's console (after the job supervisor's own "Runtime env is setting up" and
        # "Running entrypoint for job ..."), teardown included, is one of the project's own formats: none from
        # Ray (its raylet's published warnings, token authentication), DeepSpeed, transformers' bars or vLLM
        from app.console import is_own_line

        driver_console = console.split("Running entrypoint for job ", 1)[-1].split("\n", 1)[-1]
        foreign = [line for line in re.split(r"[\r\n]+", driver_console) if line.strip() and not is_own_line(line)]
        assert not foreign, "lines that are not the project's on the console:\n" + "\n".join(foreign)
        run_logs = out / "job" / "logs"
        assert (run_logs / "driver.log").is_file() and (run_logs / "ray").is_dir(), sorted(
            p.name for p in run_logs.iterdir())
        assert any((run_logs / "ray").glob("worker-*")), "Ray's worker logs are not reachable from RUN_DIR/logs/ray"
    finally:
        end_process(head)
        # `ray start` records its address for later plain `ray.init()` calls; the cluster is gone, so
        # drop the record it left (only if it is ours), or those calls try to join a dead cluster.
        current = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
        if current.exists() and current.read_text().strip().endswith(f":{gcs}"):
            current.unlink()
