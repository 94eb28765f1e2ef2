"""The async GRPO driver: config -> preflight -> registry, buffer, metrics -> rollout service ->
rollout workers -> TorchTrainer.fit -> exported adapter, summary and plot.

    cfg = config.load("recipes/tiny-cpu.yaml")
    summary = run(cfg)

Everything the run writes goes under `run.out_dir/run.name/`: config.yaml, metrics.jsonl,
reward_curve.png, summary.json, adapter/ (the final PEFT adapter) and Ray Train's checkpoints.
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path

import yaml

from common.config import Config, ConfigError, needs_merge

logger = logging.getLogger("app")


def preflight(cfg: Config) -> list[dict]:
    """Everything that can fail before an actor starts: model dir, data and columns, target modules."""
    from app.data import load_prompts
    from app.tiny_model import ensure_model

    if (reason := needs_merge(cfg)) and cfg.sync.mode == "adapter":
        logger.warning("sync.mode=adapter but %s: falling back to merge mode (full weights each publish)", reason)
        cfg.sync.mode = "merge"
    ensure_model(cfg.model.path, cfg.model.build_tiny, cfg.model.tiny_seed, cfg.model.tiny_shape)
    rows = load_prompts(cfg.data)
    _check_targets(cfg)
    return rows


def _check_targets(cfg: Config) -> None:
    """Unknown lora.target_modules fail here, on a weightless (meta) copy of the model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from train_loops.lora import check_target_modules

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.model.path))
    check_target_modules(model, cfg.lora.target_modules)


def _init_ray(cfg: Config) -> None:
    import ray

    if ray.is_initialized():
        return
    address = cfg.run.ray_address or os.environ.get("RAY_ADDRESS")
    env = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           # Ray Train gives a worker group 60 s to start; a loaded 2-core machine can need more.
           "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": os.environ.get("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "600")}
    ray.init(address=address or None, log_to_driver=True, runtime_env={"env_vars": env})


class StallError(RuntimeError):
    """No step finished and nothing was generated for `run.stall_timeout_s`."""


class _Progress:
    """tqdm over optimizer steps, fed from the RunMetrics actor; also polls router stats into it and
    watches for a stall (no step and no generation for `run.stall_timeout_s`)."""

    def __init__(self, cfg: Config, metrics, router, buffer, registry, enabled: bool):
        from tqdm import tqdm

        self.metrics, self.router, self.buffer, self.registry = metrics, router, buffer, registry
        self.stall_timeout = cfg.run.stall_timeout_s
        self._last_progress = self._last_note = time.monotonic()
        self._last_put = -1
        self.bar = tqdm(total=cfg.train.total_steps, desc=f"GRPO {cfg.run.name}", unit="step", disable=not enabled)
        self.rows: list[dict] = []
        self._last_stats = 0.0

    def poll(self) -> None:
        import ray

        new = ray.get(self.metrics.get_rows.remote(len(self.rows)))
        if new:
            self._last_progress = self._last_note = time.monotonic()
        else:
            self._watch()
        for r in new:
            self.rows.append(r)
            self.bar.update(1)
            self.bar.set_postfix(reward=f"{r.get('reward_mean', float('nan')):.3f}", ver=r.get("version", 0),
                                 stale=r.get("staleness_mean", 0))
        if time.monotonic() - self._last_stats > 5.0:
            self._last_stats = time.monotonic()
            try:
                s = self.router.stats.remote().result(timeout_s=10)
                ray.get(self.metrics.set_extra.remote(router_metrics(s)))
            except Exception as e:  # stats are advisory; never stop training for them
                logger.debug("router stats failed: %s", e)

    def _watch(self) -> None:
        """No new step: generation that still moves (groups arriving, requests in flight) is progress;
        past the timeout with neither, raise StallError with the state that explains it."""
        import ray

        now = time.monotonic()
        if now - self._last_note < min(30.0, self.stall_timeout / 3):
            return
        self._last_note = now
        buf = ray.get(self.buffer.stats.remote())
        ongoing = self._ongoing()
        if buf["put_groups"] != self._last_put or ongoing:
            self._last_put = buf["put_groups"]
            self._last_progress = now
        waited = now - self._last_progress
        logger.info("waiting for step %d: buffer %s, %s requests in flight", len(self.rows) + 1, buf, ongoing)
        if waited >= self.stall_timeout:
            raise StallError(
                f"stalled: no step and no generation for {waited:.0f}s (run.stall_timeout_s) while waiting for step "
                f"{len(self.rows) + 1}; buffer {buf}; registry live versions "
                f"{ray.get(self.registry.live_versions.remote())}; replicas {self._replica_state()}")

    def _ongoing(self) -> int:
        try:
            s = self.router.stats.remote().result(timeout_s=10)
        except Exception:  # an unreachable router is not proof of generation
            return 0
        return sum(int(r.get("ongoing", 0)) for r in s.get("replicas", []))

    def _replica_state(self) -> list:
        try:
            s = self.router.stats.remote().result(timeout_s=10)
        except Exception as e:
            return [f"router unreachable: {e}"]
        return [{k: r.get(k) for k in ("replica_id", "ongoing", "versions")} for r in s.get("replicas", [])] + \
            [f"error: {e}" for e in s.get("replica_errors", [])]

    def close(self) -> None:
        self.bar.close()


def router_metrics(stats: dict) -> dict:
    """Flatten the router's stats into the numbers a step row carries."""
    hits, queries = stats.get("prefix_cache_hits", 0), stats.get("prefix_cache_queries", 0)
    router = stats.get("router", {}) or {}
    out = {"vllm_prefix_hit_rate": hits / queries if queries else 0.0}
    for k in ("affinity_rate", "predicted_hit_rate", "spill", "unmatched"):
        if isinstance(router.get(k), (int, float)):
            out[f"router_{k}"] = router[k]
    return out


def run(cfg: Config, *, keep_serving: bool = False, progress: bool = True,
        extra_loop_cfg: dict | None = None) -> dict:
    """One training run; returns the summary. With keep_serving the Serve app stays up afterwards."""
    import ray
    from ray import serve

    from app.buffer import BUFFER_NAME, RolloutBuffer
    from app.loggers import tracking_options
    from app.metrics import METRICS_NAME, RunMetrics
    from app.registry import NAMESPACE, get_or_create_registry
    from app.report import plot_rewards, summarize, write_summary
    from app.rollout_worker import RolloutWorker
    from serve_deployments.app_builder import start_service, wait_healthy
    from train_loops.trainer import build_trainer

    rows = preflight(cfg)
    # Actors and replicas run in other working directories: hand them absolute paths.
    cfg.model.path = str(Path(cfg.model.path).resolve())
    cfg.run.out_dir = str(Path(cfg.run.out_dir).resolve())
    _fresh_run_dir(cfg)
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    t0 = time.time()
    _init_ray(cfg)
    _check_fits(cfg)

    registry = get_or_create_registry(keep=cfg.sync.max_staleness + 1)
    metrics = RunMetrics.options(name=METRICS_NAME, namespace=NAMESPACE).remote(
        str(run_dir), cfg.run.name, tracking=tracking_options(cfg))
    buffer = RolloutBuffer.options(name=BUFFER_NAME, namespace=NAMESPACE).remote(
        cfg.sync.max_staleness, cfg.grpo.prompts_per_step, lead=0 if cfg.run.mode == "sync" else None)
    workers: list = []
    keep, status = False, "FAILED"
    try:
        router = start_service(cfg, registry=registry)
        wait_healthy(router)
        logger.info("rollout service up: %d replicas (%.1fs)", cfg.rollout.replicas, time.time() - t0)

        workers = [RolloutWorker.remote(cfg.to_dict(), i, rows, buffer, metrics) for i in range(cfg.rollout.workers)]
        worker_runs = [w.run.remote() for w in workers]
        trainer = build_trainer(cfg, run_dir, resume_from=cfg.checkpoint.resume_from, extra_loop_cfg=extra_loop_cfg)

        outcome: dict = {}
        fit = threading.Thread(target=lambda: outcome.update(result=_fit(trainer)), daemon=True)
        fit.start()
        prog = _Progress(cfg, metrics, router, buffer, registry, progress)
        try:
            while fit.is_alive():
                fit.join(timeout=1.0)
                prog.poll()
                _raise_worker_errors(worker_runs)
            prog.poll()
        finally:
            prog.close()
            ray.get(buffer.close.remote())
        result = outcome.get("result")
        if isinstance(result, BaseException):
            raise result
        if result.error is not None:
            raise RuntimeError(f"training failed: {result.error}")

        adapter_dir = _export_adapter(result, run_dir)
        wall = time.time() - t0
        train_rows = ray.get(metrics.get_rows.remote())
        if not train_rows:
            raise RuntimeError(f"training finished without a single step (run dir {run_dir})")
        summary = summarize(train_rows, wall, {**idle_fractions(train_rows, cfg.rollout.workers * cfg.rollout.groups_per_worker),
            "mode": cfg.run.mode, "max_staleness": cfg.sync.max_staleness, "sync_mode": cfg.sync.mode,
            "adapter_dir": str(adapter_dir) if adapter_dir else None,
            "checkpoint": result.checkpoint.path if result.checkpoint else None,
            "registry_live_versions": ray.get(registry.live_versions.remote()),
            "buffer": ray.get(buffer.stats.remote()),
        })
        write_summary(run_dir, summary)
        plot_rewards(train_rows, run_dir / "reward_curve.png", title=f"{cfg.run.name} ({cfg.run.mode})")
        keep = keep_serving
        status = "FINISHED"
        return summary
    finally:
        try:  # trackers flush and close their run (MLflow marks it FINISHED or FAILED); ray.kill would not
            ray.get(metrics.close.remote(status), timeout=60)
        except Exception as e:
            logger.warning("metrics close failed: %s", e)
        # Success, failure or interrupt: this run's actors end with it (their names free for the next
        # run in the same cluster), and so does its service unless it is kept to serve the policy.
        for actor in [*workers, buffer, metrics]:
            _kill(actor)
        if keep:
            _SERVING[cfg.rollout.app_name] = registry  # a named actor dies with its last handle
        else:
            try:
                serve.delete(cfg.rollout.app_name)
            except Exception as e:  # teardown must reach the registry even if Serve is gone
                logger.warning("could not delete Serve app %s: %s", cfg.rollout.app_name, e)
            _kill(registry)


def _kill(actor) -> None:
    import ray

    try:
        ray.kill(actor)
    except Exception:  # already dead
        pass


def _fresh_run_dir(cfg: Config) -> None:
    """Never write into an earlier run's directory: take the next free `NAME-k` and say so."""
    base = cfg.run.name
    k = 1
    while cfg.run_dir.exists():
        k += 1
        cfg.run.name = f"{base}-{k}"
    if k > 1:
        logger.warning("run dir %s exists: this run writes to %s", Path(cfg.run.out_dir) / base, cfg.run_dir)


def _check_fits(cfg: Config) -> None:
    """A run the cluster cannot place would wait forever for resources: refuse it with the numbers."""
    import ray

    from common.placement import fit_problems

    problems = fit_problems(cfg, ray.cluster_resources())
    if problems:
        raise ConfigError(problems)


_SERVING: dict = {}


def stop_serving(app_name: str) -> None:
    """End what `run(..., keep_serving=True)` left up: the Serve app and its registry."""
    import ray
    from ray import serve

    serve.delete(app_name)
    registry = _SERVING.pop(app_name, None)
    if registry is not None:
        ray.kill(registry)


def idle_fractions(rows: list[dict], workers: int) -> dict:
    """Trainer idle = time waiting for a batch / step time; generation idle = 1 - time the rollout
    workers spent generating / (workers x wall time). Both over steps 2.. (step 1 waits for warm-up)."""
    steady = rows[1:] if len(rows) > 1 else rows
    if not steady:
        return {"trainer_idle_fraction": None, "generation_idle_fraction": None}
    wall = steady[-1]["time"] - rows[0]["time"] if len(rows) > 1 else steady[0].get("step_seconds", 0.0)
    gen_busy = sum(r.get("gen_seconds_sum", 0.0) for r in steady)
    return {
        "trainer_idle_fraction": sum(r.get("batch_wait_seconds", 0.0) for r in steady)
        / max(1e-9, sum(r.get("step_seconds", 0.0) for r in steady)),
        "generation_idle_fraction": max(0.0, 1.0 - gen_busy / max(1e-9, workers * wall)),
    }


def wall_train(rows: list[dict]) -> float:
    """Seconds from the first to the last step row (plus the first step's own duration)."""
    if not rows:
        return 0.0
    return rows[-1]["time"] - rows[0]["time"] + rows[0].get("step_seconds", 0.0)


def _fit(trainer):
    try:
        return trainer.fit()
    except BaseException as e:  # surfaced in the driver thread
        return e


def _raise_worker_errors(worker_runs) -> None:
    """A rollout worker that died (bad reward function, router error) fails the run loudly."""
    import ray

    done, _ = ray.wait(worker_runs, num_returns=len(worker_runs), timeout=0)
    for ref in done:
        ray.get(ref)  # raises the worker's exception; a clean return means data ran out


def _export_adapter(result, run_dir: Path) -> Path | None:
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


__all__ = ["run", "preflight", "ConfigError"]
