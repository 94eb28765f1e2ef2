"""What benchmarks/gpu_pipeline.py's phase modules share: the workload (one dict: --smoke and the smoke children
update it in place), the numbers' helpers, and the helpers that run and watch the phases' child processes."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The phases' child processes run this script (its main() dispatches _peft, _bare, _run).
SCRIPT = REPO / "benchmarks" / "gpu_pipeline.py"

WORKLOAD = {"shape": "qwen2.5-1.5b", "lora_rank": 1, "target_modules": "all-linear", "prompts_per_step": 16,
            "group_size": 8, "prompt_tokens": 256, "new_tokens": 1024, "ignore_eos": True, "max_staleness": 2,
            "dtype": "bfloat16"}
SMOKE = {"shape": "tiny", "prompts_per_step": 2, "group_size": 4, "prompt_tokens": 16, "new_tokens": 16}
if os.environ.get("GPU_PIPELINE_SMOKE") == "1":  # --smoke, inherited by the phases' child processes
    WORKLOAD.update(SMOKE)
# Dense bf16 peak of an H100/H200 SXM (the MFU convention of the TRL and Megatron reports).
PEAK_BF16_FLOPS = 989e12


# Rollout phase: rounds of one pass of 16 x 8 completions per side, the first a warm-up (one GPU's passes
# drifted by +-12% when each side ran its passes in a block). Each engine gets ROLLOUT_MEM of the GPU:
# the workload's KV cache needs about 5 GB of it.
ROLLOUT_REPS = int(os.environ.get("GPU_PIPELINE_ROLLOUT_REPS", "6"))
ROLLOUT_MEM = 0.4


def _median(xs):
    import statistics

    return statistics.median(xs) if xs else None


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")


def model_dir(root: Path, shape: str) -> Path:
    from app.tiny_model import build_model_shape

    d = root / f"{shape}-model"
    if not (d / "config.json").exists():
        t0 = time.time()
        build_model_shape(d, shape)
        print(f"model {shape} built in {time.time() - t0:.0f} s", flush=True)
    return d


def run_logged(cmd: list[str], log: Path, limit_s: float | None) -> int | None:
    """Run `cmd` with its output going to `log` as it comes (a run killed later still leaves it); past
    `limit_s` its process group is killed. The exit status, or None when it had to be killed."""
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            return proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            f.write(f"\n[gpu_pipeline] killed at its limit of {limit_s:.0f} s\n")
            return None


@contextlib.contextmanager
def sigint_at(deadline_s: float | None, grace_s: float = 60.0):
    """SIGINT to this process at `deadline_s` (the driver then stops after the current step and writes what
    it has), and again `grace_s` later (stop at once); both timers cancelled on exit. Yields a list that
    gets one entry per signal sent."""
    fired: list[float] = []
    if not deadline_s:
        yield fired
        return

    def interrupt():
        fired.append(time.time())
        os.kill(os.getpid(), signal.SIGINT)

    timers = [threading.Timer(t, interrupt) for t in (deadline_s, deadline_s + grace_s)]
    for t in timers:
        t.daemon = True
        t.start()
    try:
        yield fired
    finally:
        for t in timers:
            t.cancel()


def _dmon_start(path: Path):
    """`nvidia-smi dmon` once a second for the run: whether the one GPU is busy while the trainer waits
    or generation idles (SM %, memory-bandwidth %)."""
    import shutil

    if not shutil.which("nvidia-smi"):
        return None
    return subprocess.Popen(["nvidia-smi", "dmon", "-s", "u", "-d", "1"], stdout=path.open("w"),
                            stderr=subprocess.DEVNULL)


def _dmon_summary(path: Path) -> dict:
    """Mean SM and memory utilization over the samples where the GPU was in use at all (start-up excluded
    by that), plus the fraction of such samples at >= 90% SM."""
    if not path.exists():
        return {}
    sm, mem = [], []
    for line in path.read_text().splitlines():
        f = line.split()
        if not f or f[0].startswith("#") or len(f) < 3 or not f[1].isdigit():
            continue
        if int(f[1]) > 0:
            sm.append(int(f[1]))
            mem.append(int(f[2]) if f[2].isdigit() else 0)
    if not sm:
        return {}
    return {"gpu_sm_util_mean": sum(sm) / len(sm), "gpu_mem_util_mean": sum(mem) / len(mem),
            "gpu_sm_ge90_fraction": sum(x >= 90 for x in sm) / len(sm), "gpu_busy_samples": len(sm)}


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
