"""The end of a finished run: the final adapter copied to RUN_DIR/adapter, summary.json (rewards, idle
fractions, staleness, the registry's and buffer's last state, the evals) and reward_curve.png."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

from app.eval_schedule import EvalSchedule
from app.run_actors import RunActors
from common.config import Config


def export_adapter(result, run_dir: Path) -> Path | None:
    """The final checkpoint's PEFT adapter as RUN_DIR/adapter (None when the run saved none)."""
    if result.checkpoint is None:
        return None
    src = Path(result.checkpoint.path) / "adapter"
    if not src.is_dir():
        return None
    dst = run_dir / "adapter"
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst


def finish_run(cfg: Config, result, actors: RunActors, evals: EvalSchedule | None, started: float) -> dict:
    """Export the adapter, write summary.json and the reward curve; returns the summary. `result`: the
    trainer's ray.train.Result; `started`: time.time() when the run started Ray."""
    import ray

    from app.report import idle_fractions, plot_rewards, summarize, write_summary

    run_dir = cfg.run_dir
    adapter_dir = export_adapter(result, run_dir)
    wall = time.time() - started
    rows = ray.get(actors.metrics.get_rows.remote())
    if not rows:
        raise RuntimeError(f"training finished without a single step (run dir {run_dir})")
    in_flight = cfg.rollout.workers * cfg.rollout.groups_per_worker
    # A finished run short of its steps ended on its time budget (the trainer stops early for nothing else
    # that lets the run finish).
    short = int(rows[-1]["step"]) < cfg.train.total_steps
    summary = summarize(rows, wall, {
        **idle_fractions(rows, in_flight),
        "total_steps": cfg.train.total_steps, "ended_by": "train.max_minutes" if short else "train.total_steps",
        "mode": cfg.run.mode, "max_staleness": cfg.sync.max_staleness, "sync_mode": cfg.sync.mode,
        "adapter_dir": str(adapter_dir) if adapter_dir else None,
        "checkpoint": result.checkpoint.path if result.checkpoint else None,
        "registry_live_versions": ray.get(actors.registry.live_versions.remote()),
        "buffer": ray.get(actors.buffer.stats.remote()),
        **(evals.summary() if evals is not None else {}),
    })
    write_summary(run_dir, summary)
    plot_rewards(rows, run_dir / "reward_curve.png", title=f"{cfg.run.name} ({cfg.run.mode})")
    return summary
