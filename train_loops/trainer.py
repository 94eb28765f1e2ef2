"""The Ray Train wrapper around the per-worker loop: one TorchTrainer per training run."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from common.config import Config
from common.placement import trainer_resources
from train_loops.worker import WorkerOptions, loop_config, train_loop_per_worker

# Worker-group restarts Ray Train makes (each from the last reported checkpoint) before the run fails, for callers
# without a watch of their own. The driver passes -1 (unbounded: Ray Train counts over the whole run, and a long
# run meets many faults) and bounds restarts in a row with no step between them itself (train.max_restarts).
MAX_FAILURES = 2


def build_trainer(cfg: Config, run_dir: str | Path, *, resume_from: str | None = None,
                  train_run_name: str | None = None, options: WorkerOptions | None = None,
                  max_failures: int = MAX_FAILURES, loop=None):
    """TorchTrainer over `cfg.train.num_workers` workers; `.fit()` runs it.

    Checkpoints land under `run_dir/<run.name>/checkpoint_<step>`; Ray keeps `checkpoint.keep` of them.
    A worker failure restarts the group (up to `max_failures` times; -1: no limit) and the loop resumes from the last
    reported checkpoint via `ray.train.get_checkpoint()`; `resume_from` (Train V2 has no
    resume_from_checkpoint) travels in the workers' options and is used only when Ray has no checkpoint.
    `options` (default: the run's named actors) says how the workers run; `loop` (default
    train_loop_per_worker) is the function each worker runs (train_loops.harness passes its own).
    `train_run_name` (default run.name): Ray Train's run name under run_dir; a resumed run uses a new one so
    Ray's bookkeeping of the earlier attempt plays no part (the driver finds checkpoints under all of them)."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    options = options or WorkerOptions()
    if resume_from:
        options = replace(options, resume_from=str(Path(resume_from).resolve()))
    train = cfg.train
    return TorchTrainer(
        loop or train_loop_per_worker,
        train_loop_config=loop_config(cfg, options),
        torch_config=TorchConfig(backend="nccl" if train.use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=train.num_workers, use_gpu=train.use_gpu,
                                     resources_per_worker=trainer_resources(cfg)),
        run_config=RunConfig(
            name=train_run_name or cfg.run.name,
            storage_path=str(Path(run_dir).resolve()),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep),
            failure_config=FailureConfig(max_failures=max_failures),
            worker_runtime_env={"env_vars": env} if (env := worker_env(cfg)) else None,
        ),
    )


def worker_env(cfg: Config) -> dict[str, str]:
    """Variables the train workers need before their CUDA context exists (Ray Train's `worker_runtime_env`;
    Ray merges them into the job's). Only what differs from CUDA's defaults, so a CPU run's workers are
    unchanged."""
    env = {}
    if cfg.train.mps_priority != "normal":
        env["CUDA_MPS_CLIENT_PRIORITY"] = "1"  # NVIDIA's values: 0 NORMAL, 1 BELOW_NORMAL
    if cfg.train.mps_sm_percent < 100:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(cfg.train.mps_sm_percent)
    return env
