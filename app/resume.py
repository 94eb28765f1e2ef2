"""Resume (`python -m app train --resume RUN_DIR`): the same RUN_DIR continues from its newest complete
checkpoint, after a clean stop or a SIGKILL of the driver.

- `prepare_resume` reads RUN_DIR's config.yaml (plus `--set` overrides) and finds the checkpoint;
- the trainer restores weights, optimizer, RNG, step and version from it under a fresh Ray Train run
  name (`train_run_name`), so Ray's own bookkeeping of the killed attempt plays no part;
- `republish` makes the checkpoint's adapter the registry's live version before the replicas start, so
  they serve it and rollouts sample under it;
- the buffer skips exactly the prompts the checkpointed steps trained on (the checkpoint's data record,
  common/data_cursor.py) and metrics.jsonl keeps the rows up to the checkpoint's step.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from common.config import Config


class ResumeError(ValueError):
    """`--resume` of a directory that cannot be resumed (no run, no checkpoint, finished)."""


@dataclass
class Resume:
    """What `--resume RUN_DIR` continues from: the newest complete checkpoint and its train_state."""

    run_dir: Path
    checkpoint: Path
    state: dict = field(default_factory=dict)

    @property
    def step(self) -> int:
        return int(self.state.get("step", 0))

    @property
    def version(self) -> int:
        return int(self.state.get("version", 0))


def complete_checkpoint(ckpt_dir: Path, world: int) -> dict | None:
    """train_state.json of a checkpoint directory holding everything a restore reads, else None (a copy
    cut short by a kill)."""
    try:
        state = json.loads((ckpt_dir / "train_state.json").read_text())
    except (OSError, ValueError):
        return None
    need = [ckpt_dir / "adapter" / "adapter_config.json", ckpt_dir / "adapter" / "adapter_model.safetensors",
            ckpt_dir / "ds" / "mp_rank_00_model_states.pt", *[ckpt_dir / f"rng_rank{r}.pt" for r in range(world)]]
    if not all(p.is_file() for p in need) or not isinstance(state.get("step"), int):
        return None
    return state


def find_checkpoint(run_dir: Path, world: int = 1) -> tuple[Path, dict] | None:
    """The run's newest complete checkpoint (highest step) over every Ray Train run under RUN_DIR (the
    first attempt's and each resume's)."""
    best = None
    for ckpt_dir in sorted(Path(run_dir).glob("*/checkpoint_*")):
        state = complete_checkpoint(ckpt_dir, world) if ckpt_dir.is_dir() else None
        if state is not None and (best is None or state["step"] > best[1]["step"]):
            best = (ckpt_dir, state)
    return best


def prepare_resume(run_dir: str | Path, sets: list[str] | None = None) -> tuple[Config, Resume]:
    """RUN_DIR's config (plus `--set` overrides) and the checkpoint to continue from; ResumeError (one
    line) for a directory that is not a run, has no checkpoint, or finished."""
    from common.config import load

    resolved = Path(run_dir).resolve()
    if not (resolved / "config.yaml").is_file():
        raise ResumeError(f"--resume {run_dir}: not a run directory (no config.yaml)")
    if (resolved / "summary.json").is_file():
        raise ResumeError(f"--resume {run_dir}: the run finished (summary.json); nothing to resume")
    cfg = load(str(resolved / "config.yaml"), list(sets or []))
    cfg = cfg.replace(run={"out_dir": str(resolved.parent), "name": resolved.name})
    found = find_checkpoint(resolved, cfg.train.num_workers)
    if found is None:
        raise ResumeError(f"--resume {run_dir}: no complete checkpoint to resume from (the run stopped before "
                          f"its first; checkpoint.every={cfg.checkpoint.every})")
    ckpt, state = found
    if int(state["step"]) >= cfg.train.total_steps:
        raise ResumeError(f"--resume {run_dir}: the run finished (checkpoint at step {state['step']} of "
                          f"train.total_steps={cfg.train.total_steps}); nothing to resume")
    return cfg, Resume(resolved, ckpt, state)


def train_run_name(cfg: Config, resume: Resume | None) -> str:
    """Ray Train's run name under RUN_DIR: the run's name, then NAME-resume-K for the K-th resume."""
    if resume is None:
        return cfg.run.name
    attempt = 1
    while (cfg.run_dir / f"{cfg.run.name}-resume-{attempt}").exists():
        attempt += 1
    return f"{cfg.run.name}-resume-{attempt}"


def republish(cfg: Config, registry, resume: Resume) -> None:
    """Before the replicas start: the checkpoint's adapter goes live under the checkpoint's version, so
    the replicas load it in their constructors and rollouts sample the policy the trainer resumes."""
    import ray

    from common.adapter_io import make_meta, pack_tensors, read_peft_dir

    version = resume.version
    if version < 1 or ray.get(registry.latest_version.remote()) >= version:
        return
    tensors, peft_cfg = read_peft_dir(resume.checkpoint / "adapter")
    if cfg.sync.mode == "merge":
        from train_loops.merge import load_base_state, lora_pairs, merged_state

        payload = merged_state(load_base_state(cfg.model.path), lora_pairs(tensors, peft_cfg))
        meta = make_meta(payload, None, kind="merged")
    else:
        payload, meta = tensors, make_meta(tensors, peft_cfg, kind="adapter")
    ray.get(registry.attach_ingress.remote(None))  # no app yet: the registry just holds it, live
    ray.get(registry.publish.remote(version, ray.put(pack_tensors(payload)), meta))
