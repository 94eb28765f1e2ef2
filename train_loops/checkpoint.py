"""Resumable LoRA-only checkpoints.

Layout of one checkpoint directory:
  ds/...               DeepSpeed save_checkpoint(exclude_frozen_parameters=True), written by all ranks:
                       LoRA weights, optimizer (ZeRO shards), no base weights
  rng_rank{r}.pt       each rank's torch/python RNG state
  train_state.json     step, policy version, consumed-groups cursor (rank 0)
  adapter/             PEFT export (adapter_config.json + adapter_model.safetensors) from rank 0

Under Ray Train every rank writes into its own local directory and reports it; Ray merges them into
one checkpoint in storage (file names never collide). Under torchrun all ranks share one directory."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from common.adapter_io import write_peft_dir

DS_TAG = "ds"
STATE_FILE = "train_state.json"
ADAPTER_DIR = "adapter"


def save(engine, directory: str | Path, *, rank: int, state: dict, lora: dict[str, torch.Tensor],
         peft_config: dict) -> Path:
    """Collective (every rank calls it with the same directory layout)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    engine.save_checkpoint(str(directory), tag=DS_TAG, exclude_frozen_parameters=True)
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, directory / f"rng_rank{rank}.pt")
    if rank == 0:
        write_peft_dir(lora, peft_config, directory / ADAPTER_DIR)
        (directory / STATE_FILE).write_text(json.dumps(state, indent=2))
    if dist.is_initialized():
        dist.barrier()
    return directory


def load(engine, directory: str | Path, *, rank: int) -> dict:
    """Restore LoRA weights, optimizer and RNG into a freshly built engine; returns train_state."""
    directory = Path(directory)
    if not (directory / STATE_FILE).is_file():
        raise FileNotFoundError(f"{directory}: not a trainer checkpoint (no {STATE_FILE})")
    # Frozen base weights are not in the checkpoint: they come from the model directory.
    path, _ = engine.load_checkpoint(str(directory), tag=DS_TAG, load_module_strict=False)
    if path is None:
        raise RuntimeError(f"{directory}: DeepSpeed found no checkpoint under tag {DS_TAG!r}")
    rng_file = directory / f"rng_rank{rank}.pt"
    if rng_file.is_file():
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
    return json.loads((directory / STATE_FILE).read_text())


def trim(parent: Path, keep: int) -> None:
    """Keep the newest `keep` checkpoint_* directories (torchrun mode; Ray Train trims its own)."""
    ckpts = sorted(p for p in parent.glob("checkpoint_*") if p.is_dir())
    for old in ckpts[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
