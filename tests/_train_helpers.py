"""Shared pieces of the trainer tests: a tiny model, small configs, and a torchrun launcher."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from common.config import Config, from_dict, validate

REPO = Path(__file__).resolve().parents[1]


_TINY: dict[int, Path] = {}


def tiny_model(seed: int = 0) -> Path:
    """One tiny model per seed per test process (building one costs seconds); tests only read it."""
    import atexit
    import shutil
    import tempfile

    from app.tiny_model import build_tiny_model

    if seed not in _TINY:
        d = Path(tempfile.mkdtemp(prefix=f"tiny-model-{seed}-"))
        atexit.register(shutil.rmtree, d, True)
        _TINY[seed] = build_tiny_model(d / "model", seed=seed)
    return _TINY[seed]


def small_config(model_path: Path, **sections) -> Config:
    """4 prompts x 4 samples, short completions, fp32, 2 workers; `sections` override per section."""
    d = {
        "model": {"path": str(model_path), "build_tiny": False, "dtype": "float32"},
        "lora": {"rank": 4, "alpha": 8.0, "target_modules": "all-linear"},
        "grpo": {"group_size": 4, "prompts_per_step": 4, "lr": 1e-2, "max_new_tokens": 12},
        "train": {"num_workers": 2, "cpus_per_worker": 0.5, "zero_stage": 2, "total_steps": 2,
                  "logprob_chunk": 16, "seed": 0},
        "checkpoint": {"every": 0, "keep": 3},
        "rollout": {"max_lora_rank": 8},
    }
    for sec, vals in sections.items():
        d.setdefault(sec, {}).update(vals)
    cfg = from_dict(d)
    validate(cfg)
    return cfg


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(loop_cfg: dict, workdir: Path, nproc: int = 2, timeout: int = 240) -> str:
    """Run train_loops.worker under torchrun; returns combined output, raises with it on failure."""
    workdir.mkdir(parents=True, exist_ok=True)
    cfg_file = workdir / f"loop_cfg_{len(list(workdir.glob('loop_cfg_*')))}.json"
    cfg_file.write_text(json.dumps(loop_cfg))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={_free_port()}", "-m", "train_loops.worker", str(cfg_file)]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    out = p.stdout + p.stderr
    if p.returncode != 0:
        raise AssertionError(f"torchrun failed (rc {p.returncode}):\n{out[-6000:]}")
    return out


def read_steps(dump_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (dump_dir / "steps.jsonl").read_text().splitlines()]
