"""The async GRPO run, top to bottom: preflight -> run dir -> Ray -> the run's actors -> rollout service
-> rollout workers -> trainer -> watch loop -> final eval -> summary -> teardown.

    cfg = config.load("recipes/tiny-cpu.yaml")
    summary = run(cfg)

Everything the run writes goes under `run.out_dir/run.name/`: config.yaml, metrics.jsonl,
reward_curve.png, summary.json, adapter/ (the final PEFT adapter), logs/ and Ray Train's checkpoints.

Where each part lives: app/preflight.py (checks, run dir), app/console.py (console and log files),
common/ray_utils.py (`init_ray`), app/run_actors.py (registry, metrics, buffer; teardown),
app/service.py (the Serve app), app/rollout_worker.py, train_loops/trainer.py, app/watch.py (progress,
stall, Ctrl-C), app/eval_schedule.py, app/summary.py, app/resume.py (`--resume RUN_DIR`).

Ctrl-C once: the trainer checkpoints after the current step and the run stops (resumable); twice: stop
at once. Either way the Serve app and the run's actors are removed.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from app.console import Console
from app.resume import Resume
from app.service import stop_serving
from common.config import Config

logger = logging.getLogger("app")


def run(cfg: Config, *, keep_serving: bool = False, progress: bool = True, verbose: bool = False,
        resume: Resume | None = None) -> dict:
    """One training run; returns the summary. With keep_serving the Serve app stays up afterwards
    (`stop_serving` ends it). The console is quiet unless verbose (see Console); RUN_DIR/logs/ holds the
    engines' logs. `resume` (from app.resume.prepare_resume) continues an earlier run in its own directory.
    A run stopped by Ctrl-C returns {"interrupted": True, ...} (no summary.json: it is resumable)."""
    from cluster.gpu_mps import mps_for_run

    console = Console(None, verbose)
    try:
        with mps_for_run(cfg):  # train.mps: a CUDA MPS daemon before Ray starts, or one line saying why not
            return _run(cfg, console, keep_serving=keep_serving, progress=progress, verbose=verbose, resume=resume)
    finally:
        console.close()


def _run(cfg: Config, console: Console, *, keep_serving: bool, progress: bool, verbose: bool,
         resume: Resume | None) -> dict:
    import ray

    from app.eval_schedule import EvalSchedule
    from app.evaluate import eval_rows
    from app.judge_service import start_judge_service, stop_judge_service
    from app.preflight import check_fits, make_run_dir, preflight
    from app.resume import republish, train_run_name
    from app.rollout_worker import start_workers
    from app.run_actors import start_run_actors
    from app.service import front_url, start_rollout_service
    from app.summary import finish_run
    from app.watch import Progress, train_and_watch
    from common.ray_utils import init_ray
    from train_loops.trainer import build_trainer

    if cfg.run.fleet:  # the run's rollouts go to its fleet's app
        from common.names import fleet_app

        cfg = cfg.replace(rollout={"app_name": fleet_app(cfg.run.fleet)})
    cfg, rows = preflight(cfg)
    cfg, run_dir = make_run_dir(cfg, resume)
    console.attach_file(run_dir / "logs")
    if resume is not None:
        logger.info("resume: %s from %s (step %d, version %d)", run_dir, resume.checkpoint.relative_to(run_dir),
                    resume.step, resume.version)
    held_out = eval_rows(cfg) if cfg.eval.path else None
    started = time.time()
    init_ray(cfg, verbose)
    console.adopt_ray_loggers()
    _log_cluster(cfg, run_dir)
    check_fits(cfg)

    actors = start_run_actors(cfg, rows, resume)
    status, keep = "FAILED", False
    try:
        if resume is not None:
            republish(cfg, actors.registry, resume)
        if cfg.run.fleet:
            ingress = _attach_to_fleet(cfg, actors)
        else:
            ingress = start_rollout_service(cfg, actors.registry, verbose,
                                            last_step=resume.step if resume is not None else 0)
            logger.info("service: app %r, %d vLLM replicas behind the ingress (%s routing), %s (%.0fs)",
                        cfg.rollout.app_name, cfg.rollout.replicas, cfg.router.policy,
                        front_url(cfg.rollout.app_name) or f"http://127.0.0.1:{cfg.rollout.http_port}/v1",
                        time.time() - started)

        if cfg.reward.judge.model:  # the judge model's own app, beside the policy's (app/judge_service.py)
            start_judge_service(cfg, last_step=resume.step if resume is not None else 0)
        actors.workers = start_workers(cfg)  # restartable; a restart frees its slots
        actors.runs = worker_runs = [w.run.remote() for w in actors.workers]
        evals = None
        if held_out:
            evals = EvalSchedule(cfg, held_out, actors.metrics)
            actors.evaluator = evals.actor
            if resume is None:
                evals.kick(0, None)  # the starting policy, beside the first rollouts
        resume_from = str(resume.checkpoint) if resume is not None else cfg.checkpoint.resume_from
        # Restarts are bounded by the watch (train.max_restarts in a row without a step), not by Ray Train's
        # count over the whole run.
        trainer = build_trainer(cfg, run_dir, resume_from=resume_from, train_run_name=train_run_name(cfg, resume),
                                max_failures=-1)
        _log_trainer(cfg, held_out)

        watch = Progress(cfg, actors.metrics, ingress, actors.buffer, actors.registry, progress, evals,
                         rows=ray.get(actors.metrics.get_rows.remote()) if resume is not None else None)
        watch.lease = actors.lease
        outcome = train_and_watch(trainer, watch, actors.buffer, worker_runs)
        if outcome.interrupted and outcome.stopped_cleanly and watch.last_step < cfg.train.total_steps:
            logger.warning("stopped at step %d of %d (checkpoint saved); continue with: python -m app train "
                           "--resume %s", watch.last_step, cfg.train.total_steps, run_dir)
            status = "KILLED"
            checkpoint = outcome.result.checkpoint
            # the buffer's counts so far (drops, moved groups): a benchmark stopped at its deadline still reports them
            return {"interrupted": True, "steps": watch.last_step, "run_dir": str(run_dir),
                    "checkpoint": checkpoint.path if checkpoint else None, "buffer": _buffer_stats(actors.buffer)}
        if evals is not None and watch.rows and not outcome.raised:
            evals.finish(watch.last_step, watch.rows[-1].get("version"))
        summary = finish_run(cfg, outcome.checked_result(), actors, evals, started)
        status, keep = "FINISHED", keep_serving
        return {**summary, "run_dir": str(run_dir)}  # preflight may have renamed it (NAME-k)
    finally:
        actors.teardown(cfg, status, keep)
        stop_judge_service(cfg)


def _attach_to_fleet(cfg: Config, actors):
    """Attach the run to its fleet (a lease, renewed until the run ends) and point its registry at the fleet's
    ingress with the run's name and token; returns the run's view of the ingress."""
    import ray

    from app.fleet import FleetLease
    from common.run_ingress import ingress_for

    actors.lease = FleetLease(cfg)
    token = actors.lease.attach()
    ray.get(actors.registry.attach_ingress.remote(cfg.rollout.app_name, None, cfg.run.name, token))
    return ingress_for(cfg)


def _log_cluster(cfg: Config, run_dir: Path) -> None:
    import ray

    # The GCS address it really is on: a plain ray.init() joins the last `ray start` cluster it finds, and
    # a user should see which cluster a "local" run landed on.
    address = cfg.run.ray_address or os.environ.get("RAY_ADDRESS")
    gcs = ray.get_runtime_context().gcs_address
    where = f"local cluster {gcs}" if address in (None, "", "local") else f"joined {address} ({gcs})"
    resources = ray.cluster_resources()
    logger.info("ray: %s, %s CPUs%s; engine logs in %s", where,
                int(resources.get("CPU", 0)), f", {int(resources['GPU'])} GPUs" if resources.get("GPU") else "",
                run_dir / "logs")


def _log_trainer(cfg: Config, held_out: list[dict] | None) -> None:
    logger.info("trainer: %d %s workers (DeepSpeed ZeRO-%d), %s mode, %d rollout workers, %d steps%s",
                cfg.train.num_workers, "GPU" if cfg.train.use_gpu else "CPU", cfg.train.zero_stage, cfg.run.mode,
                cfg.rollout.workers, cfg.train.total_steps,
                f"; eval on {len(held_out)} prompts of {cfg.eval.path} every {cfg.eval.every} steps"
                if held_out else "")


def _buffer_stats(buffer) -> dict | None:
    """The run's RolloutBuffer counts; None when it cannot answer (a stop is not the place to fail)."""
    import ray

    try:
        return ray.get(buffer.stats.remote(), timeout=30)
    except Exception:  # the buffer actor died with whatever stopped the run
        return None


__all__ = ["run", "stop_serving"]
