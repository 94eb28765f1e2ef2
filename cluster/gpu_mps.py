"""CUDA MPS for a GPU that the trainer and a vLLM replica share (recipes/gpu-1x.yaml).

Without MPS, two processes on one GPU are time-sliced: their kernels take turns. On one H200 the trainer
learned a step in 3.7 s while the engine was idle and in ~7 s while it decoded (BENCHMARKS.md, "One H200,
one sitting"); the decode's short, host-paced kernels leave most of the SMs idle during their turn. Under
MPS the processes' kernels run side by side. MPS changes no setting of the card: the control daemon is a
process of this user, with its pipe and log folders in `root`, and `quit` ends it.

    with mps_daemon(Path("/tmp/mps")):   # before Ray starts: its workers inherit the two variables
        ray.init(...)
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"
# A CUDA context made through the daemon, and a kernel run in it.
CUDA_PROBE = ("import torch; x = torch.ones(1024, device='cuda'); torch.cuda.synchronize(); "
              "assert float(x.sum()) == 1024.0")
ENV_KEYS = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")


class MpsError(RuntimeError):
    pass


@contextlib.contextmanager
def mps_daemon(root: Path, probe: list[str] | None = None) -> Iterator[dict]:
    """Start an MPS control daemon for this process and its children (os.environ gets the pipe and log
    folders, as Ray's workers need them), stop it on exit and put the environment back.

    `probe`: a command run as the daemon's first client before the caller's work. A daemon can start and
    still serve no client (a container without the IPC it needs); that shows only when a process makes
    its CUDA context, which for a pipeline run is minutes in, inside a Ray worker. A failing probe stops
    the daemon and raises MpsError with the probe's output."""
    exe = shutil.which(CONTROL)
    if exe is None:
        raise MpsError(f"{CONTROL} is not on PATH: CUDA MPS needs the NVIDIA driver's utilities on this node")
    pipe, log = root / "pipe", root / "log"
    pipe.mkdir(parents=True, exist_ok=True)
    log.mkdir(parents=True, exist_ok=True)
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(log)}
    proc = subprocess.run([exe, "-d"], env={**os.environ, **env}, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise MpsError(f"{CONTROL} -d failed (exit {proc.returncode}): {(proc.stderr or proc.stdout).strip()[-500:]}")
    if probe is not None:
        try:
            check = subprocess.run(probe, env={**os.environ, **env}, capture_output=True, text=True, timeout=180)
            bad = check.returncode != 0 and f"exit {check.returncode}: {(check.stderr or check.stdout).strip()[-500:]}"
        except subprocess.TimeoutExpired:
            bad = "no answer in 180 s"
        if bad:
            _quit(exe, env)
            raise MpsError(f"the MPS daemon started but its first client failed ({bad}); log: {log}")
    saved = {k: os.environ.get(k) for k in ENV_KEYS}
    os.environ.update(env)
    try:
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _quit(exe, env)


def _quit(exe: str, env: dict) -> None:
    subprocess.run([exe], input="quit\n", env={**os.environ, **env}, capture_output=True, text=True, timeout=60)


@contextlib.contextmanager
def mps_if_supported(root: Path, say=print, joining: str | None = None) -> Iterator[dict | None]:
    """CUDA MPS where this machine supports it, time-slicing where not: one line from `say` names which and,
    when off, why (no control binary, a daemon that serves no client, `joining` a Ray cluster whose workers
    started without it). Yields the daemon's environment, or None when off. Enter it before Ray starts."""
    if joining:
        say(f"CUDA MPS off: {joining}; the trainer and the replica time-slice the GPU")
        yield None
        return
    try:
        daemon = mps_daemon(root, probe=[sys.executable, "-c", CUDA_PROBE])
        env = daemon.__enter__()
    except MpsError as e:
        say(f"CUDA MPS off: {e}; the trainer and the replica time-slice the GPU")
        yield None
        return
    say(f"CUDA MPS on: the trainer's and the replica's kernels share the GPU (daemon in {root})")
    try:
        yield env
    finally:
        daemon.__exit__(None, None, None)


def mps_for_run(cfg) -> contextlib.AbstractContextManager:
    """`train.mps` for one `app train` run: mps_if_supported around the whole run (Ray starts inside it, so
    its workers inherit the daemon's folders); nothing when the key is off."""
    if not cfg.train.mps:
        return contextlib.nullcontext()
    import logging
    import tempfile

    import ray

    address = cfg.run.ray_address or os.environ.get("RAY_ADDRESS")
    joining = ("Ray is already up in this process, its workers started without the daemon" if ray.is_initialized()
               else f"joining the Ray cluster at {address}, whose workers started without the daemon"
               if address not in (None, "", "local") else None)
    root = Path(tempfile.gettempdir()) / f"lora-grpo-mps-{os.getpid()}"
    return mps_if_supported(root, say=logging.getLogger("app").info, joining=joining)
