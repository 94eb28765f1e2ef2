"""The async GRPO driver: config -> preflight -> registry, buffer, metrics -> rollout service ->
rollout workers -> TorchTrainer.fit -> exported adapter, summary and plot.

    cfg = config.load("recipes/tiny-cpu.yaml")
    summary = run(cfg)

Everything the run writes goes under `run.out_dir/run.name/`: config.yaml, metrics.jsonl,
reward_curve.png, summary.json, adapter/ (the final PEFT adapter) and Ray Train's checkpoints.

Resume (`python -m app train --resume RUN_DIR`, `prepare_resume` + `run(cfg, resume=...)`): the same
RUN_DIR continues from its newest complete checkpoint, after a clean stop or a SIGKILL of this process:
- the trainer restores weights, optimizer, RNG, step and version from it (a fresh Ray Train run name
  under RUN_DIR, so Ray's own bookkeeping of the killed attempt plays no part);
- the registry publishes the checkpoint's adapter as its version before the replicas start, so they
  serve it and rollouts sample under it;
- the buffer hands out prompts skipping exactly those the checkpointed steps trained on (the
  checkpoint's data record, common/data_cursor.py); what the killed attempt generated or took after the
  checkpoint died with it and its prompts are handed out again;
- metrics.jsonl keeps the rows up to the checkpoint's step and drops those written after it.
Ctrl-C once: the trainer checkpoints after the current step and the run stops (exit 130, resumable);
twice: stop at once. Either way the Serve app and the named actors are removed.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
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


# Loggers of the engines in this (driver) process; quiet on the console unless --verbose, always in
# RUN_DIR/logs/driver.log.
ENGINE_LOGGERS = ("ray", "ray.serve", "ray.train", "ray.tune", "ray.data", "vllm", "DeepSpeed", "deepspeed",
                  "transformers", "torch", "filelock", "urllib3", "httpx")


def _init_ray(cfg: Config, verbose: bool = False) -> None:
    """Quiet by default, through Ray's own switches: workers' stdout/stderr stay in Ray's session log
    files (log_to_driver=False), worker-side Ray logging at WARNING (LoggingConfig), the driver's Ray
    logger at WARNING; vLLM and DeepSpeed levels travel in the job's env. --verbose streams everything."""
    import ray

    if ray.is_initialized():
        return
    address = cfg.run.ray_address or os.environ.get("RAY_ADDRESS")
    level = "INFO" if verbose else "WARNING"
    env = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           # Ray Train gives a worker group 60 s to start; a loaded 2-core machine can need more.
           "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": os.environ.get("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "600"),
           "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", level),
           "DS_LOG_LEVEL": os.environ.get("DS_LOG_LEVEL", level.lower()),
           "TRANSFORMERS_VERBOSITY": os.environ.get("TRANSFORMERS_VERBOSITY", "info" if verbose else "error"),
           "PYTHONWARNINGS": os.environ.get("PYTHONWARNINGS", "default" if verbose else "ignore")}
    os.environ.setdefault("VLLM_LOGGING_LEVEL", env["VLLM_LOGGING_LEVEL"])  # read by engine_env for replicas
    ray.init(address=address or None, log_to_driver=verbose, logging_level=logging.INFO if verbose else logging.ERROR,
             logging_config=ray.LoggingConfig(encoding="TEXT", log_level=level), runtime_env={"env_vars": env})


class _TqdmHandler(logging.StreamHandler):
    """Console log lines written above the progress bar (tqdm.write), so the bar stays one line."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


class _QuietFilter(logging.Filter):
    """On the console: this project's INFO lines; other libraries' only at ERROR (their INFO and WARNING
    lines are in RUN_DIR/logs/driver.log)."""

    def filter(self, record: logging.LogRecord) -> bool:
        ours = record.name in ("app", "__main__") or record.name.startswith(("app.", "common", "train_loops",
                                                                               "serve_deployments"))
        return record.levelno >= (logging.INFO if ours else logging.ERROR)


class Console:
    """The run's console and log files: console lines go through tqdm (above the bar), filtered unless
    verbose; RUN_DIR/logs/driver.log gets every record of this process (INFO and up, engines included).
    `close()` restores the logging setup it found and links Ray's session logs into RUN_DIR/logs/ray."""

    def __init__(self, logs_dir: Path | None, verbose: bool = False):
        import sys
        import warnings

        self.verbose, self.logs_dir = verbose, logs_dir
        root = logging.getLogger()
        self._saved = (root.level, list(root.handlers), {n: (logging.getLogger(n).level, logging.getLogger(n).propagate)
                                                          for n in ENGINE_LOGGERS})
        fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
        console = _TqdmHandler(sys.stderr)
        console.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S") if not verbose else fmt)
        if not verbose:
            console.addFilter(_QuietFilter())
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            warnings.filterwarnings("ignore", category=FutureWarning)
        self._fmt, self.file, self.console = fmt, None, console
        import ray  # noqa: F401  (installs Ray's own console handlers now, so they can be taken over below)

        # Ray's own records stop at the "ray" logger (ray.init puts its LoggingConfig handler on the root):
        # console at ERROR unless verbose, driver.log at INFO.
        self.ray_console = _TqdmHandler(sys.stderr)
        self.ray_console.setFormatter(fmt)
        self.ray_console.setLevel(logging.INFO if verbose else logging.ERROR)
        root.handlers = [console]
        root.setLevel(logging.INFO)
        for n in ENGINE_LOGGERS:  # one path for every record: the root's handlers (Ray's: the "ray" logger's)
            lg = logging.getLogger(n)
            lg.handlers, lg.propagate = [h for h in lg.handlers if not isinstance(h, logging.StreamHandler)], True
            lg.setLevel(logging.INFO if verbose or n.startswith("ray") else logging.WARNING)
        self._route_ray()
        if logs_dir is not None:
            self.attach_file(logs_dir)

    def _route_ray(self) -> None:
        lg = logging.getLogger("ray")
        lg.handlers = [h for h in (self.ray_console, self.file) if h is not None]
        lg.propagate = False
        lg.setLevel(logging.INFO)

    def attach_file(self, logs_dir: Path) -> None:
        """Every record of this process (INFO and up, engines included) also goes to logs_dir/driver.log."""
        self.logs_dir = logs_dir
        logs_dir.mkdir(parents=True, exist_ok=True)
        self.file = logging.FileHandler(logs_dir / "driver.log")
        self.file.setFormatter(self._fmt)
        logging.getLogger().addHandler(self.file)
        self._route_ray()
        logging.captureWarnings(True)

    def adopt_ray_loggers(self) -> None:
        """ray.init (its LoggingConfig) reconfigures the root logger and Ray's loggers: ours again."""
        root = logging.getLogger()
        root.handlers = [self.console] + ([self.file] if self.file is not None else [])
        root.setLevel(logging.INFO)
        for n in ENGINE_LOGGERS:
            lg = logging.getLogger(n)
            if n.startswith("ray."):
                lg.handlers = [h for h in lg.handlers if not isinstance(h, logging.StreamHandler)]
                lg.propagate = True
                lg.setLevel(logging.INFO)
        self._route_ray()

    def close(self) -> None:
        import contextlib

        if self.logs_dir is not None:
            with contextlib.suppress(Exception):
                import ray

                src = Path(ray._private.worker._global_node.get_logs_dir_path())  # this session's logs
                link = self.logs_dir / "ray"
                if link.is_symlink() and Path(os.readlink(link)) != src:  # a resumed run: keep the earlier one
                    k = 1
                    while (self.logs_dir / f"ray-{k}").exists() or (self.logs_dir / f"ray-{k}").is_symlink():
                        k += 1
                    link.rename(self.logs_dir / f"ray-{k}")
                if src.is_dir() and not link.exists():
                    link.symlink_to(src, target_is_directory=True)
            with contextlib.suppress(Exception):
                self.file.close()
            logging.captureWarnings(False)
        root = logging.getLogger()
        level, handlers, loggers = self._saved
        root.handlers, root.level = handlers, level
        for n, (_, prop) in loggers.items():  # levels stay as set: atexit hooks (torch) log after this
            logging.getLogger(n).propagate = prop
        logging.getLogger("ray").handlers = [self.ray_console]


class StallError(RuntimeError):
    """No step finished and nothing was generated for `run.stall_timeout_s`."""


class _Progress:
    """tqdm over optimizer steps, fed from the RunMetrics actor; also polls router stats into it and
    watches for a stall (no step and no generation for `run.stall_timeout_s`)."""

    def __init__(self, cfg: Config, metrics, router, buffer, registry, enabled: bool, evals=None,
                 rows: list[dict] | None = None):
        from tqdm import tqdm

        self.metrics, self.router, self.buffer, self.registry = metrics, router, buffer, registry
        self.evals = evals
        self.stall_timeout = cfg.run.stall_timeout_s
        self.log_every = cfg.run.log_every
        self._last_progress = self._last_note = time.monotonic()
        self._last_put = -1
        self.rows: list[dict] = list(rows or [])  # a resumed run's rows up to its checkpoint
        self.bar = tqdm(total=cfg.train.total_steps, initial=len(self.rows), desc=f"GRPO {cfg.run.name}", unit="step",
                        disable=not enabled, dynamic_ncols=True, mininterval=1.0)
        self._last_stats = 0.0
        self._sync_s: float | None = None
        self._replicas: set | None = None
        self._warned: dict = {}

    def poll(self) -> None:
        import ray

        new = ray.get(self.metrics.get_rows.remote(len(self.rows)))
        if new:
            self._last_progress = self._last_note = time.monotonic()
        else:
            self._watch()
        for r in new:
            self.rows.append(r)
            if isinstance(r.get("publish_seconds"), (int, float)):
                self._sync_s = r["publish_seconds"]
            self.bar.update(1)
            self.bar.set_postfix_str(
                f"reward={r.get('reward_mean', float('nan')):.3f} ver={r.get('version', 0)} "
                f"stale={r.get('staleness_mean', 0):.2f} tok/s={r.get('gen_tokens_per_s', 0):.0f} "
                f"sync={'-' if self._sync_s is None else f'{1e3 * self._sync_s:.0f}ms'}", refresh=False)
            self._warn_counts(r)
            if self.evals is not None:
                self.evals.on_step(r)
            if r["step"] % self.log_every == 0:
                logger.info(self.summary_line(r))
        if self.evals is not None:
            self.evals.poll()
        if time.monotonic() - self._last_stats > 5.0:
            self._last_stats = time.monotonic()
            try:
                s = self.router.stats.remote().result(timeout_s=10)
                ray.get(self.metrics.set_extra.remote(router_metrics(s)))
                self._watch_replicas(s)
            except Exception as e:  # stats are advisory; never stop training for them
                logger.debug("router stats failed: %s", e)

    def summary_line(self, r: dict) -> str:
        """One line per run.log_every steps: the last log_every steps' reward, the latest eval, staleness,
        dropped samples, throughput and sync latency."""
        last = self.rows[-self.log_every:]
        rew = [x["reward_mean"] for x in last if isinstance(x.get("reward_mean"), (int, float))]
        tps = [x["gen_tokens_per_s"] for x in last if isinstance(x.get("gen_tokens_per_s"), (int, float))]
        pub = [x["publish_seconds"] for x in last if isinstance(x.get("publish_seconds"), (int, float))]
        parts = [f"step {r['step']}/{self.bar.total}", f"reward {sum(rew) / len(rew):.3f}" if rew else "reward -"]
        ev = self.evals.latest if self.evals is not None else None
        if ev:
            parts.append(f"eval acc {ev['eval/accuracy']:.3f} (v{ev['eval/version']})")
        parts += [f"version {r.get('version', 0)}", f"staleness {r.get('staleness_mean', 0):.2f}",
                  f"dropped {r.get('dropped_samples', 0)}",
                  f"gen {sum(tps) / len(tps):.0f} tok/s" if tps else "gen - tok/s",
                  f"sync {1e3 * sorted(pub)[len(pub) // 2]:.0f} ms" if pub else "sync -"]
        return " | ".join(parts)

    def _warn_counts(self, r: dict) -> None:
        """Counters that need a human the first time they move (then they ride on the summary lines)."""
        for key, what in (("dropped_samples", "samples dropped as too stale (sync.max_staleness)"),
                          ("rollout_failed_groups", "rollout groups failed after retries (replicas lost?)"),
                          ("rollout_retries", "rollout groups retried after a lost replica/ingress"),
                          ("version_mismatches", "served-version mismatches: samples from the wrong weights")):
            v = r.get(key)
            if isinstance(v, (int, float)) and v > self._warned.get(key, 0) and (
                    key not in self._warned or v >= 2 * self._warned[key]):
                logger.warning("step %d: %s %s so far", r["step"], int(v), what)
                self._warned[key] = v

    def _watch_replicas(self, stats: dict) -> None:
        """A replica that disappears or is replaced (Serve restarted it) is worth a line."""
        ids = {str(x.get("replica_id")) for x in stats.get("replicas", [])}
        if self._replicas is not None and ids != self._replicas:
            gone, new = sorted(self._replicas - ids), sorted(ids - self._replicas)
            logger.warning("replicas changed: %s%s", f"lost {gone} " if gone else "", f"new {new}" if new else "")
        errs = stats.get("replica_errors") or []
        if errs and errs != self._warned.get("replica_errors"):
            logger.warning("replicas not answering: %s", errs[:2])
        self._warned["replica_errors"] = errs
        self._replicas = ids

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
        (logger.warning if waited >= self.stall_timeout / 2 else logger.debug)(
            "waiting for step %d: buffer %s, %s requests in flight", len(self.rows) + 1, buf, ongoing)
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


class _Evals:
    """Evaluation beside training: an Evaluator actor (app/evaluate.py) scores the version just published
    every `eval.every` steps (and the base model before step 1, the final version after the last step).
    Kicked and collected from the driver loop without waiting; while one eval runs, a due one is skipped.
    Results go to RunMetrics.log_eval (the next step row carries them)."""

    def __init__(self, cfg: Config, rows: list[dict], metrics):
        from app.evaluate import Evaluator

        self.every, self.metrics = cfg.eval.every, metrics
        self.actor = Evaluator.remote(cfg.to_dict(), rows)
        self.pending = None  # (ref, step)
        self.results: list[dict] = []
        self.latest: dict | None = None
        self.last_step = -1
        self._failed = 0

    def kick(self, step: int, version: int | None) -> bool:
        if self.pending is not None:
            return False
        self.pending = (self.actor.run.remote(version, step), step)
        self.last_step = step
        return True

    def on_step(self, row: dict) -> None:
        if row["step"] % self.every == 0:
            self.kick(row["step"], row.get("version"))

    def poll(self, timeout: float = 0) -> None:
        import ray

        if self.pending is None:
            return
        ref, step = self.pending
        done, _ = ray.wait([ref], timeout=timeout)
        if not done:
            return
        self.pending = None
        try:
            res = ray.get(ref)
        except Exception as e:  # evaluation is advisory: a failed one is reported, training goes on
            self._failed += 1
            logger.warning("eval at step %d failed: %s", step, (str(e).strip().splitlines() or [""])[-1][:200])
            return
        self.results.append(res)
        self.latest = res
        ray.get(self.metrics.log_eval.remote(step, res))

    def finish(self, final_step: int, version: int | None, timeout: float = 300.0) -> None:
        """After the last step: wait for a running eval, then score the final version (unless done)."""
        self.poll(timeout)
        if self.last_step != final_step and self.kick(final_step, version):
            self.poll(timeout)
        if self.pending is not None:
            logger.warning("eval at step %d did not finish in %.0fs; left out", self.pending[1], timeout)

    def summary(self) -> dict:
        out: dict = {"eval_history": [{k: v for k, v in r.items() if k != "eval/seconds"} for r in self.results]}
        if self.results:
            first, last = self.results[0], self.results[-1]
            out.update({"eval_first": first["eval/accuracy"], "eval_first_step": first["eval/step"],
                        **{k: v for k, v in last.items() if k.startswith("eval/")}})
        return out


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
        extra_loop_cfg: dict | None = None, verbose: bool = False, resume: Resume | None = None) -> dict:
    """One training run; returns the summary. With keep_serving the Serve app stays up afterwards.
    The console is quiet unless verbose (see Console); RUN_DIR/logs/ holds the engines' logs.
    `resume` (from `prepare_resume`) continues an earlier run in its own directory. A run stopped by
    Ctrl-C returns a summary with "interrupted": True (no summary.json: it is resumable)."""
    console = Console(None, verbose)
    try:
        return _run(cfg, console, keep_serving=keep_serving, progress=progress, extra_loop_cfg=extra_loop_cfg,
                    verbose=verbose, resume=resume)
    finally:
        console.close()


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


def _complete_checkpoint(d: Path, world: int) -> dict | None:
    """train_state.json of a checkpoint directory holding everything a restore reads, else None (a copy
    cut short by a kill)."""
    try:
        state = json.loads((d / "train_state.json").read_text())
    except (OSError, ValueError):
        return None
    need = [d / "adapter" / "adapter_config.json", d / "adapter" / "adapter_model.safetensors",
            d / "ds" / "mp_rank_00_model_states.pt", *[d / f"rng_rank{r}.pt" for r in range(world)]]
    if not all(p.is_file() for p in need) or not isinstance(state.get("step"), int):
        return None
    return state


def find_checkpoint(run_dir: Path, world: int = 1) -> tuple[Path, dict] | None:
    """The run's newest complete checkpoint (highest step) over every Ray Train run under RUN_DIR (the
    first attempt's and each resume's)."""
    best = None
    for d in sorted(Path(run_dir).glob("*/checkpoint_*")):
        state = _complete_checkpoint(d, world) if d.is_dir() else None
        if state is not None and (best is None or state["step"] > best[1]["step"]):
            best = (d, state)
    return best


def prepare_resume(run_dir: str | Path, sets: list[str] | None = None) -> tuple[Config, Resume]:
    """RUN_DIR's config (plus `--set` overrides) and the checkpoint to continue from; ResumeError (one
    line) for a directory that is not a run, has no checkpoint, or finished."""
    from common.config import load

    d = Path(run_dir).resolve()
    if not (d / "config.yaml").is_file():
        raise ResumeError(f"--resume {run_dir}: not a run directory (no config.yaml)")
    if (d / "summary.json").is_file():
        raise ResumeError(f"--resume {run_dir}: the run finished (summary.json); nothing to resume")
    cfg = load(str(d / "config.yaml"), list(sets or []))
    cfg.run.out_dir, cfg.run.name = str(d.parent), d.name
    found = find_checkpoint(d, cfg.train.num_workers)
    if found is None:
        raise ResumeError(f"--resume {run_dir}: no complete checkpoint to resume from (the run stopped before "
                          f"its first; checkpoint.every={cfg.checkpoint.every})")
    ckpt, state = found
    if int(state["step"]) >= cfg.train.total_steps:
        raise ResumeError(f"--resume {run_dir}: the run finished (checkpoint at step {state['step']} of "
                          f"train.total_steps={cfg.train.total_steps}); nothing to resume")
    return cfg, Resume(d, ckpt, state)


def _train_run_name(cfg: Config, resume: Resume | None) -> str:
    """Ray Train's run name under RUN_DIR: the run's name, then NAME-resume-K for the K-th resume."""
    if resume is None:
        return cfg.run.name
    k = 1
    while (cfg.run_dir / f"{cfg.run.name}-resume-{k}").exists():
        k += 1
    return f"{cfg.run.name}-resume-{k}"


def _republish(cfg: Config, registry, resume: Resume) -> None:
    """Before the replicas start: the checkpoint's adapter goes live under the checkpoint's version, so
    the replicas load it in their constructors and rollouts sample the policy the trainer resumes."""
    import ray

    from common.adapter_io import make_meta, read_peft_dir

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
    ray.get(registry.attach_router.remote(None))  # no app yet: the registry just holds it, live
    ray.get(registry.publish.remote(version, ray.put(payload), meta))


class _CtrlC:
    """SIGINT while training: the first asks the trainer (through the buffer) to checkpoint after its
    current step and end; the second raises KeyboardInterrupt at once (teardown still runs)."""

    def __init__(self, buffer):
        self.buffer, self.count, self._old = buffer, 0, None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.count += 1
        if self.count > 1:
            raise KeyboardInterrupt
        logger.warning("Ctrl-C: stopping after the current step's checkpoint (Ctrl-C again to stop at once)")
        try:
            self.buffer.request_stop.remote()
        except Exception:
            raise KeyboardInterrupt from None

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


def _start_serve(cfg: Config, verbose: bool) -> None:
    """Serve's controller and proxy log to RUN_DIR/logs/serve (Serve's LoggingConfig), WARNING and up unless
    verbose; a Serve instance already running keeps its own settings."""
    from ray import serve
    from ray.serve.schema import LoggingConfig

    serve.start(http_options={"host": "0.0.0.0", "port": cfg.rollout.http_port},
                logging_config=LoggingConfig(log_level="INFO" if verbose else "WARNING",
                                             logs_dir=str(cfg.run_dir / "logs" / "serve"),
                                             enable_access_log=verbose))


def _run(cfg: Config, console: Console, *, keep_serving: bool, progress: bool, extra_loop_cfg: dict | None,
         verbose: bool, resume: Resume | None = None) -> dict:
    import ray
    from ray import serve

    from app.buffer import BUFFER_NAME, RolloutBuffer
    from app.loggers import tracking_options
    from app.metrics import METRICS_NAME, RunMetrics
    from app.report import plot_rewards, summarize, write_summary
    from app.rollout_worker import start_workers
    from common.registry import NAMESPACE, get_or_create_registry
    from serve_deployments.app_builder import start_service, wait_healthy
    from train_loops.trainer import build_trainer

    rows = preflight(cfg)
    # Actors and replicas run in other working directories: hand them absolute paths.
    cfg.model.path = str(Path(cfg.model.path).resolve())
    cfg.run.out_dir = str(Path(cfg.run.out_dir).resolve())
    if resume is None:
        _fresh_run_dir(cfg)
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=resume is not None)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    console.attach_file(run_dir / "logs")
    if resume is not None:
        logger.info("resume: %s from %s (step %d, version %d)", run_dir, resume.checkpoint.relative_to(run_dir),
                    resume.step, resume.version)
    eval_rows_ = None
    if cfg.eval.path:
        from app.evaluate import eval_rows

        eval_rows_ = eval_rows(cfg)
    t0 = time.time()
    _init_ray(cfg, verbose)
    console.adopt_ray_loggers()
    import ray as _ray

    logger.info("ray: %s, %s CPUs%s; engine logs in %s", "joined " + str(cfg.run.ray_address or os.environ.get(
        "RAY_ADDRESS")) if (cfg.run.ray_address or os.environ.get("RAY_ADDRESS")) else "local cluster",
        int(_ray.cluster_resources().get("CPU", 0)),
        f", {int(_ray.cluster_resources().get('GPU', 0))} GPUs" if _ray.cluster_resources().get("GPU") else "",
        run_dir / "logs")
    _check_fits(cfg)

    registry = get_or_create_registry(keep=cfg.sync.max_staleness + 1)
    metrics = RunMetrics.options(name=METRICS_NAME, namespace=NAMESPACE).remote(
        str(run_dir), cfg.run.name, tracking=tracking_options(cfg),
        resume_step=resume.step if resume is not None else None)
    # The buffer is the run's one prompt source (common/data_cursor.py); a resume skips exactly what the
    # checkpointed steps trained on.
    buffer = RolloutBuffer.options(name=BUFFER_NAME, namespace=NAMESPACE).remote(
        cfg.sync.max_staleness, cfg.grpo.prompts_per_step, lead=0 if cfg.run.mode == "sync" else None,
        rows=rows, seed=cfg.data.shuffle_seed, epochs=cfg.data.epochs,
        consumed=resume.state.get("data") if resume is not None else None,
        trainer_version=resume.version if resume is not None else 0)
    workers: list = []
    evals = None
    keep, status = False, "FAILED"
    interrupted = False
    try:
        if resume is not None:
            _republish(cfg, registry, resume)
        _start_serve(cfg, verbose)
        router = start_service(cfg, registry=registry)
        wait_healthy(router)
        logger.info("service: app %r, %d vLLM replicas behind the %s router, http://127.0.0.1:%d/v1 (%.0fs)",
                    cfg.rollout.app_name, cfg.rollout.replicas, cfg.router.policy, cfg.rollout.http_port,
                    time.time() - t0)

        workers = start_workers(cfg, rows, buffer, metrics)  # restartable; a restart frees its slots
        worker_runs = [w.run.remote() for w in workers]
        if eval_rows_:
            evals = _Evals(cfg, eval_rows_, metrics)
            if resume is None:
                evals.kick(0, None)  # the starting policy, beside the first rollouts
        trainer = build_trainer(cfg, run_dir, resume_from=str(resume.checkpoint) if resume is not None
                                else cfg.checkpoint.resume_from, extra_loop_cfg=extra_loop_cfg,
                                train_run_name=_train_run_name(cfg, resume))
        logger.info("trainer: %d %s workers (DeepSpeed ZeRO-%d), %s mode, %d rollout workers, %d steps%s",
                    cfg.train.num_workers, "GPU" if cfg.train.use_gpu else "CPU", cfg.train.zero_stage, cfg.run.mode,
                    cfg.rollout.workers, cfg.train.total_steps,
                    f"; eval on {len(eval_rows_)} prompts of {cfg.eval.path} every {cfg.eval.every} steps"
                    if eval_rows_ else "")

        outcome: dict = {}
        fit = threading.Thread(target=lambda: outcome.update(result=_fit(trainer)), daemon=True)
        fit.start()
        prog = _Progress(cfg, metrics, router, buffer, registry, progress, evals,
                         rows=ray.get(metrics.get_rows.remote()) if resume is not None else None)
        try:
            with _CtrlC(buffer) as ctrl_c:
                while fit.is_alive():
                    fit.join(timeout=1.0)
                    prog.poll()
                    _raise_worker_errors(worker_runs)
                prog.poll()
                interrupted = ctrl_c.count > 0
        finally:
            prog.close()
            ray.get(buffer.close.remote())
        if interrupted and not isinstance(outcome.get("result"), BaseException) and outcome["result"].error is None:
            steps = prog.rows[-1]["step"] if prog.rows else 0
            if steps < cfg.train.total_steps:
                logger.warning("stopped at step %d of %d (checkpoint saved); continue with: python -m app train "
                               "--resume %s", steps, cfg.train.total_steps, run_dir)
                status = "KILLED"
                return {"interrupted": True, "steps": steps, "run_dir": str(run_dir),
                        "checkpoint": outcome["result"].checkpoint.path if outcome["result"].checkpoint else None}
        if evals is not None and prog.rows and not isinstance(outcome.get("result"), BaseException):
            evals.finish(prog.rows[-1]["step"], prog.rows[-1].get("version"))
            ray.get(metrics.flush_eval.remote())
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
        in_flight = cfg.rollout.workers * cfg.rollout.groups_per_worker
        summary = summarize(train_rows, wall, {**idle_fractions(train_rows, in_flight),
            "mode": cfg.run.mode, "max_staleness": cfg.sync.max_staleness, "sync_mode": cfg.sync.mode,
            "adapter_dir": str(adapter_dir) if adapter_dir else None,
            "checkpoint": result.checkpoint.path if result.checkpoint else None,
            "registry_live_versions": ray.get(registry.live_versions.remote()),
            "buffer": ray.get(buffer.stats.remote()),
            **(evals.summary() if evals is not None else {}),
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
        for actor in [*workers, buffer, metrics, *([evals.actor] if evals is not None else [])]:
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
