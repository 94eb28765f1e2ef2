"""Shared pieces of the trainer tests: a tiny model, small configs, a torchrun launcher of the trainer
harness (train_loops/harness.py), and the test-only worker that fails once (fault injection stays out of the
production loop)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from common.config import Config, from_dict, validate
from common.ports import free_port
from train_loops.harness import HarnessOptions, HarnessWorker, read_loop_config
from train_loops.worker import loop_config

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



def run_torchrun(cfg: Config, options: HarnessOptions, workdir: Path, nproc: int = 2, timeout: int = 240) -> str:
    """Run train_loops.harness under torchrun with `cfg` and `options` (its JSON file goes to `workdir`);
    returns combined output, raises with it on failure."""
    workdir.mkdir(parents=True, exist_ok=True)
    cfg_file = workdir / f"loop_cfg_{len(list(workdir.glob('loop_cfg_*')))}.json"
    cfg_file.write_text(json.dumps(loop_config(cfg, options)))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", "-m", "train_loops.harness", str(cfg_file)]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    out = p.stdout + p.stderr
    if p.returncode != 0:
        raise AssertionError(f"torchrun failed (rc {p.returncode}):\n{out[-6000:]}")
    return out


def read_steps(record_dir: Path) -> list[dict]:
    """The per-step rows rank 0 wrote to HarnessOptions.record_dir."""
    return [json.loads(line) for line in (record_dir / "steps.jsonl").read_text().splitlines()]


class FailOnceWorker(HarnessWorker):
    """Test-only fault injection under Ray Train: rank `fail_rank` dies like a killed process
    (os._exit: no exception handling, no cleanup) at the start of step `fail_step`, once (`marker`, a
    file, remembers across the restart). It dies only after Ray Train has registered every checkpoint
    reported so far (`ray.train.get_all_reported_checkpoints` waits for that), so the group restores
    from the last checkpoint before that step, not an earlier one: the test knows what comes next."""

    def __init__(self, cfg: Config, options: HarnessOptions, *, fail_step: int, fail_rank: int, marker: str):
        super().__init__(cfg, options)
        self.fail_step, self.fail_rank, self.marker = fail_step, fail_rank, Path(marker)

    def step(self, step: int) -> dict:
        if step == self.fail_step and self.rank == self.fail_rank and not self.marker.exists():
            import ray.train

            ray.train.get_all_reported_checkpoints(timeout_s=120)
            self.marker.touch()
            os._exit(1)
        return super().step(step)


def fail_once_loop(fail_step: int, fail_rank: int, marker: Path):
    """The Ray Train loop function that runs FailOnceWorker (hand it to TorchTrainer in place of
    train_loops.harness.train_loop_per_worker). Ray's workers cannot import this module (tests/ is not
    installed), so it travels by value with the function."""
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

    def loop(config: dict) -> None:
        from train_loops.deepspeed_setup import prepare_env

        cfg, options = read_loop_config(config)
        prepare_env(cfg.train.use_gpu)
        FailOnceWorker(cfg, options, fail_step=fail_step, fail_rank=fail_rank, marker=str(marker)).train()

    return loop
