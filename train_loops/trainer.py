"""The Ray Train wrapper around the per-worker loop: one TorchTrainer per training run."""
from __future__ import annotations

from pathlib import Path

from common.config import Config
from common.names import METRICS_NAME, REGISTRY_NAME
from common.placement import trainer_resources
from train_loops.worker import train_loop_per_worker


def build_trainer(cfg: Config, run_dir: str | Path, *, batch_source: str = "buffer",
                  registry_name: str | None = REGISTRY_NAME, metrics_name: str | None = METRICS_NAME,
                  resume_from: str | None = None, max_failures: int = 2, ds_overrides: dict | None = None,
                  extra_loop_cfg: dict | None = None, train_run_name: str | None = None):
    """TorchTrainer over `cfg.train.num_workers` workers; `.fit()` runs it.

    Checkpoints land under `run_dir/<run.name>/checkpoint_<step>`; Ray keeps `checkpoint.keep` of them.
    A worker failure restarts the group (up to `max_failures` times) and the loop resumes from the last
    reported checkpoint via `ray.train.get_checkpoint()`; `resume_from` (Train V2 has no
    resume_from_checkpoint) travels in train_loop_config and is used only when Ray has no checkpoint.
    `extra_loop_cfg` adds loop_cfg keys (see train_loops.worker: dump_dir, fail_once_at).
    `train_run_name` (default run.name): Ray Train's run name under run_dir; a resumed run uses a new one so
    Ray's bookkeeping of the earlier attempt plays no part (the driver finds checkpoints under all of them)."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    t = cfg.train
    loop_cfg = {
        "config": cfg.to_dict(),
        "batch_source": batch_source,
        "registry_name": registry_name,
        "metrics_name": metrics_name,
        "resume_from": str(Path(resume_from).resolve()) if resume_from else None,
        "runner": "ray",
        "ds_overrides": ds_overrides,
        **(extra_loop_cfg or {}),
    }
    resources = trainer_resources(cfg)
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config=loop_cfg,
        torch_config=TorchConfig(backend="nccl" if t.use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=t.num_workers, use_gpu=t.use_gpu, resources_per_worker=resources),
        run_config=RunConfig(
            name=train_run_name or cfg.run.name,
            storage_path=str(Path(run_dir).resolve()),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep),
            failure_config=FailureConfig(max_failures=max_failures),
        ),
    )
