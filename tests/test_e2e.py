"""End to end on CPU: the tiny recipe, shortened, async, 2 vLLM replicas + 2 DeepSpeed workers, one
train worker SIGKILLed mid-run from outside (Ray Train restores from the last checkpoint), then the
endpoint serves `policy-latest` equal to the exported adapter. Real Ray, Serve, vLLM, DeepSpeed and PEFT
throughout."""
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from app.report import read_rows
from common import config as C
from common.processes import descendant_pids
from common.stats import proportion_z
from tests._serve_helpers import free_port

pytestmark = pytest.mark.slow

STEPS = 40
KILL_AFTER_STEP = 10  # checkpoints every 8 steps: the restore goes back to step 8


def _rows(path: Path) -> list[dict]:
    return read_rows(path)[0]  # a line being written is skipped


class KillTrainWorker(threading.Thread):
    """The fault, from outside the trainer: once the run has logged step `after_step`, SIGKILL one of
    Ray Train's worker processes (like an OOM kill: no goodbye). Either rank will do: Ray Train restarts
    the whole group from the last checkpoint."""

    def __init__(self, metrics_path: Path, after_step: int):
        super().__init__(daemon=True)
        self.metrics_path, self.after_step = metrics_path, after_step
        self.killed: dict = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.5):
            rows = _rows(self.metrics_path)
            if not rows or max(r["step"] for r in rows) < self.after_step:
                continue
            pids = descendant_pids("ray::RayTrainWorker")
            if pids:
                victim = max(pids)
                os.kill(victim, signal.SIGKILL)
                self.killed = {"pid": victim, "after_step": max(r["step"] for r in rows), "time": time.time()}
                return


@pytest.fixture(scope="module")
def e2e_run(tiny_model_dir, tmp_path_factory):
    import ray
    from ray import serve

    from app import driver

    out = tmp_path_factory.mktemp("e2e")
    port = free_port()
    cfg = C.load("recipes/tiny-cpu.yaml", [
        f"model.path={tiny_model_dir}", "model.build_tiny=false", f"run.out_dir={out}", "run.name=e2e",
        f"train.total_steps={STEPS}", "checkpoint.every=8", f"rollout.http_port={port}",
        "rollout.replica_http_port=0", "rollout.front_port=0"])
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false",
                                       "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "600"}})
    killer = KillTrainWorker(out / "e2e" / "metrics.jsonl", KILL_AFTER_STEP)
    try:
        serve.start(http_options={"port": port})
        killer.start()
        try:
            summary = driver.run(cfg, keep_serving=True, progress=False)
        finally:
            killer.stop.set()
        registry = ray.get_actor("adapter-registry", namespace="lora_grpo")
        latest = ray.get(registry.latest_version.remote())
        yield cfg, summary, killer.killed, latest, out, port
        from app.service import _FRONTS

        front = _FRONTS.get(cfg.rollout.app_name)
        driver.stop_serving(cfg.rollout.app_name)
        assert front is None or front.front._proc is None  # the run's front ends with its app
    finally:
        serve.shutdown()
        ray.shutdown()


def test_run_completes_after_worker_kill(e2e_run):
    cfg, summary, killed, latest, out, _ = e2e_run
    assert killed, "the train worker was not killed"
    assert summary["steps"] >= STEPS
    state = json.loads((out / "e2e" / "summary.json").read_text())
    assert state["final_version"] == latest
    for name in ("metrics.jsonl", "reward_curve.png", "summary.json", "config.yaml", "adapter/adapter_config.json"):
        assert (out / "e2e" / name).exists(), name


def test_versions_monotonic_and_within_staleness(e2e_run):
    cfg, summary, killed, latest, out, _ = e2e_run
    rows = [json.loads(line) for line in (out / "e2e" / "metrics.jsonl").read_text().splitlines()]
    # each step once (the steps redone after the restore replaced their rows), versions strictly increasing
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    versions = [r["version"] for r in rows]
    assert versions == sorted(set(versions)) and versions[-1] == latest
    assert all(r["staleness_max"] <= cfg.sync.max_staleness for r in rows)
    assert all(r["staleness_mean"] >= 0 for r in rows)


def test_reward_rises_beyond_noise(e2e_run):
    cfg, summary, killed, latest, out, _ = e2e_run
    rows = [json.loads(line) for line in (out / "e2e" / "metrics.jsonl").read_text().splitlines()]
    by_step = {}
    for r in rows:  # after the restore, replayed steps log again: keep the last row of each step
        by_step[r["step"]] = dict(r, samples=cfg.grpo.prompts_per_step * cfg.grpo.group_size)
    ordered = [by_step[s] for s in sorted(by_step)]
    k = len(ordered) // 4
    z = proportion_z(ordered[:k], ordered[-k:], cfg.grpo.prompts_per_step * cfg.grpo.group_size)
    assert z > 3.0, f"reward did not rise beyond noise: z={z:.2f}, rows={[round(r['reward_mean'], 3) for r in ordered]}"


def test_endpoint_serves_policy_latest_equal_to_export(e2e_run, tiny_model_dir):
    from transformers import AutoTokenizer

    from common.adapter_io import read_peft_dir
    from tests._serve_helpers import peft_reference, prompt_ids

    cfg, summary, killed, latest, out, port = e2e_run
    base = f"http://127.0.0.1:{port}"
    models = httpx.get(f"{base}/v1/models", timeout=30).json()
    ids = {m["id"] for m in models["data"]}
    assert "policy-latest" in ids and f"policy-v{latest}" in ids
    tensors, peft_cfg = read_peft_dir(out / "e2e" / "adapter")
    prompt = prompt_ids(tiny_model_dir, "Say the letter K, not Q or Z.")
    r = httpx.post(f"{base}/v1/completions", timeout=60, json={
        "model": "policy-latest", "prompt": prompt, "max_tokens": 4, "temperature": 0.0, "logprobs": 1})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    served_lp = choice["logprobs"]["token_logprobs"]
    meta = {"peft_config": peft_cfg}
    want_ids, want_lp = peft_reference(tiny_model_dir, tensors, meta, prompt, len(served_lp))
    assert len(served_lp) == len(want_lp)
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert choice["text"] == tok.decode(want_ids, skip_special_tokens=True)
    assert max(abs(a - b) for a, b in zip(served_lp, want_lp)) < 1e-3


def test_the_runs_rest_front_serves_what_the_serve_port_serves(e2e_run):
    """rollout.front_port on a run: the driver started the front with the service; after the run it answers
    the final policy under the same exact name and digest as the Serve port, and the same model list."""
    from app.service import _FRONTS

    cfg, summary, killed, latest, out, port = e2e_run
    front = _FRONTS[cfg.rollout.app_name].front
    serve_url = f"http://127.0.0.1:{port}/v1"

    def models(url: str) -> list[dict]:  # `created` is the second the list was made: two calls may differ by one
        listed = httpx.get(f"{url}/models", timeout=30).json()["data"]
        return [{k: v for k, v in m.items() if k != "created"} for m in listed]

    assert models(front.url) == models(serve_url)
    body = {"model": "policy-latest", "prompt": "Say the letter K", "max_tokens": 4, "temperature": 0.0,
            "ignore_eos": True}
    a, b = (httpx.post(f"{u}/completions", json=body, timeout=60) for u in (serve_url, front.url))
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    assert a.json()["model"] == b.json()["model"] == f"policy-v{latest}"
    assert a.headers["x-adapter-sha256"] == b.headers["x-adapter-sha256"]
    assert b.json()["usage"]["completion_tokens"] == 4
