"""What benchmarks/rest_vs_vllm.py and its server and client modules share: the workload (one dict: --smoke,
--rounds and --requests update it in place), the endpoints and the metrics kept from `vllm bench serve`, the
timestamped log line, the partial document a run rewrites as it goes (Progress), and the machine and code
state a document records."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

WORKLOAD = {"input_len": 48, "output_len": 32, "concurrency": 16, "requests": 160, "rounds": 4, "lora_rank": 8,
            "dataset": "random", "streaming": True, "ignore_eos": True, "model_name": "policy-v1"}
SMOKE = {"requests": 32, "rounds": 2}
ENDPOINTS = {"completions": ("openai", "/v1/completions"), "chat": ("openai-chat", "/v1/chat/completions")}


# The Serve processes of our side whose CPU time a pass records (Ray titles them ray::NAME).
REST_PROCS = {"proxy": "ProxyActor", "ingress": "ServeReplica:policy:Ingress",
              "replica": "ServeReplica:policy:RolloutReplica"}
METRICS = {"output_tok_s": "output_throughput", "request_s": "request_throughput", "ttft_p50_ms": "median_ttft_ms",
           "ttft_p99_ms": "p99_ttft_ms", "tpot_p50_ms": "median_tpot_ms", "itl_p50_ms": "median_itl_ms",
           "e2el_p50_ms": "median_e2el_ms", "completed": "completed", "failed": "failed",
           "output_tokens": "total_output_tokens", "duration_s": "duration"}


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _jsonable(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)


class Progress:
    """Stage lines (timestamped, flushed, kept) and OUT/rest_vs_vllm_{device}_partial.json, rewritten at each
    stage and after each pass, so a run killed at any point leaves the passes it finished and where it
    stopped. A run that finishes removes it (its final document has everything)."""

    def __init__(self, path: Path, base: dict, passes: int):
        self.path, self.base, self.passes = path, base, passes
        self.rounds, self.starts, self.stages = [], {}, []
        self.t0 = time.time()
        self._lock = threading.RLock()

    def passes_done(self) -> int:
        return sum(len(row.get(ep, {})) for row in self.rounds for ep in ENDPOINTS)

    def stage(self, msg: str) -> None:
        log(msg)
        with self._lock:
            self.stages.append({"at": time.strftime("%H:%M:%S"), "s": round(time.time() - self.t0, 1), "what": msg})
            self.write(f"running, {self.passes_done()} of {self.passes} passes done; last stage: {msg}")

    def write(self, reason: str, **extra) -> None:
        with self._lock:
            doc = {"partial": True, "partial_reason": reason,
                   "partial_is": "rewritten at each stage and after each pass; a run that finishes removes it, so "
                                 "one left behind was stopped (killed, or failed as partial_reason says) after its "
                                 "last stage",
                   "passes_done": self.passes_done(), "passes": self.passes, **self.base,
                   "server_start_s": self.starts, "stages": self.stages, "rounds": self.rounds,
                   "wall_s": time.time() - self.t0, "updated_at": time.strftime("%Y-%m-%d %H:%M:%S"), **extra}
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps(doc, indent=2, default=_jsonable))
            os.replace(tmp, self.path)  # whole: a kill mid-write leaves the previous one


def machine(load_at_start: list[float]) -> dict:
    import ray
    import vllm

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    info = {"cpus": os.cpu_count(), "cpu_model": cpu, "platform": platform.platform(),
            "python": platform.python_version(), "vllm": vllm.__version__, "ray": ray.__version__,
            "load_avg_1_5_15_min_at_start": load_at_start, "load_avg_1_5_15_min_at_end": list(os.getloadavg())}
    if _gpus():
        import torch

        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def code_state() -> dict:
    """The commit measured, and the serving code's uncommitted changes (others edit the same tree)."""
    def git(*a):
        r = subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else None

    dirty = git("status", "--porcelain", "--", "serve_deployments", "common", "app")
    return {"commit": git("rev-parse", "HEAD"), "uncommitted_serving_files": dirty.splitlines() if dirty else []}
