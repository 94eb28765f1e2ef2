"""DeepSpeed for a LoRA learner: config from our Config, a plain torch AdamW over the LoRA parameters,
and process-group init that reuses what Ray Train or torchrun already set up.

On CPU nothing may compile: DeepSpeed's CPU Adam / FusedAdam / optimizer offload build C++ for 70-90 s,
and its shared-memory comm op (~45 s) is built even with DS_BUILD_OPS=0 unless `build_shm_op` is
patched out before the comm backend starts (docs/ARCHITECTURE.md, "Engine facts")."""
from __future__ import annotations

import logging
import math
import os
import sys

import torch

from common.config import Config


def prepare_env(use_gpu: bool) -> None:
    """Must run before the first `import deepspeed` in the process: the accelerator is chosen at import."""
    if not use_gpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("DS_BUILD_OPS", "0")


def patch_shm_op() -> None:
    import deepspeed.comm.torch  # noqa: F401  (binds the torch package to the name; fetch the module below)

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


def init_distributed(use_gpu: bool) -> None:
    """Join the existing process group (Ray Train creates one; under torchrun DeepSpeed creates it from
    the env vars). gloo on CPU, nccl on GPU."""
    prepare_env(use_gpu)
    patch_shm_op()
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="nccl" if use_gpu else "gloo")


def ds_config(cfg: Config, world_size: int, overrides: dict | None = None) -> dict:
    t = cfg.train
    conf = {
        # The worker decides each step's micro-batches from a token budget (train_loops.micro_batches)
        # and marks the last one as the accumulation boundary itself (set_gradient_accumulation_boundary).
        # DeepSpeed 0.19's unmanaged mode (managed_gradient_accumulation: false) hangs ZeRO-3 at the
        # second step when a step has several backwards; the manual boundary works for stages 0-3.
        "train_batch_size": world_size,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": float(t.max_grad_norm),
        "zero_optimization": {"stage": t.zero_stage},
        "bf16": {"enabled": cfg.trainer_dtype == "bfloat16"},
        "fp16": {"enabled": cfg.trainer_dtype == "float16"},
        # Our optimizer is plain torch AdamW (DeepSpeed's own ones compile on CPU).
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    for k, v in (overrides or {}).items():
        if isinstance(v, dict) and isinstance(conf.get(k), dict):
            conf[k] = {**conf[k], **v}
        else:
            conf[k] = v
    return conf


def lora_optimizer(model, cfg: Config) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise RuntimeError("no trainable parameters: LoRA was not applied")
    return torch.optim.AdamW(params, lr=cfg.grpo.lr, weight_decay=cfg.grpo.weight_decay)


def lr_factor(cfg: Config, step: int) -> float:
    """The lr of optimizer step `step` (0-based) as a fraction of grpo.lr: a linear warmup over
    grpo.warmup_steps, then constant or a cosine down to grpo.min_lr_ratio at train.total_steps."""
    g, total = cfg.grpo, cfg.train.total_steps
    if step < g.warmup_steps:
        return (step + 1) / g.warmup_steps
    if g.lr_schedule == "constant":
        return 1.0
    done = min(1.0, (step - g.warmup_steps) / max(1, total - g.warmup_steps - 1))
    return g.min_lr_ratio + (1.0 - g.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * done))


def build_engine(model, cfg: Config, world_size: int, overrides: dict | None = None):
    """deepspeed.initialize over an already-LoRA-wrapped model; returns the engine. The lr schedule is a torch
    LambdaLR handed to DeepSpeed: the engine steps it at each boundary and saves and loads it with the
    checkpoint, so a resumed run continues the schedule where it stopped."""
    import deepspeed

    optimizer = lora_optimizer(model, cfg)
    scheduler = None
    if cfg.grpo.lr_schedule != "constant" or cfg.grpo.warmup_steps:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(cfg, step))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                      config=ds_config(cfg, world_size, overrides), dist_init_required=False)
    return engine
