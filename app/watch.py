"""Watching a training run from the driver: `train_and_watch` runs `trainer.fit()` in a thread while the
driver polls `Progress` (the bar, a summary line every run.log_every steps, the ingress's stats into the
step rows, warnings when replicas change or counters move, StallError when nothing moves) and fails the
run when a rollout worker dies. `CtrlC`: once asks the trainer to checkpoint and stop, twice stops at once.
"""
from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

from app.stall_errors import RestartsError, StallError, UnplaceableError
from common.config import Config

logger = logging.getLogger("app")

INGRESS_STATS_EVERY_S = 5.0
RESTART_CHECK_S = 3.0
FIT_THREAD = "trainer-fit"
# A step in flight finishes before the trainer reads the closed buffer; minutes on CPU at worst.
FIT_STOP_TIMEOUT_S = 120.0


def ingress_row_metrics(stats: dict) -> dict:
    """The ingress's stats (`Ingress.stats`) as the numbers a step row carries: vLLM's prefix-cache hit
    rate and the routing policy's counters."""
    hits, queries = stats.get("prefix_cache_hits", 0), stats.get("prefix_cache_queries", 0)
    router = stats.get("router", {}) or {}
    out = {"vllm_prefix_hit_rate": hits / queries if queries else 0.0}
    for key in ("affinity_rate", "predicted_hit_rate", "spill", "unmatched"):
        if isinstance(router.get(key), (int, float)):
            out[f"router_{key}"] = router[key]
    return out


class Progress:
    """tqdm over optimizer steps, fed from the RunMetrics actor; also polls the ingress's stats into it
    and watches for a stall (no step and no generation for `run.stall_timeout_s`). `rows`: the step rows
    so far (a resumed run starts with those up to its checkpoint)."""

    def __init__(self, cfg: Config, metrics, ingress, buffer, registry, enabled: bool, evals=None,
                 rows: list[dict] | None = None):
        from tqdm import tqdm

        self.metrics, self.ingress, self.buffer, self.registry = metrics, ingress, buffer, registry
        self.evals = evals
        self.stall_timeout = cfg.run.stall_timeout_s
        self.log_every = cfg.run.log_every
        self._last_progress = self._last_note = self._last_restart_check = time.monotonic()
        self._last_put = -1
        self.rows: list[dict] = list(rows or [])
        self.bar = tqdm(total=cfg.train.total_steps, initial=len(self.rows), desc=f"GRPO {cfg.run.name}", unit="step",
                        disable=not enabled, dynamic_ncols=True, mininterval=1.0)
        self._last_stats = 0.0
        self._sync_s: float | None = None
        self._replicas: set | None = None
        self._warned: dict = {}
        self.lease = None  # app.fleet.FleetLease of a run on a fleet: the run ends if the fleet forgot it
        from app.placement_watch import PlacementWatch

        self.placement = PlacementWatch(cfg)  # UnplaceableError when Ray cannot place the run any more
        self.max_restarts = cfg.train.max_restarts
        self.max_worker_restarts = cfg.rollout.max_restarts
        self._starts_at_step: int | None = None  # the buffer's trainer_starts when the last step was logged
        self._worker_starts_at_step: dict = {}  # each rollout worker's incarnations then

    @property
    def last_step(self) -> int:
        return self.rows[-1]["step"] if self.rows else 0

    def poll(self) -> None:
        import ray

        if self.lease is not None and self.lease.lost:
            from app.fleet import FleetLeaseLost

            raise FleetLeaseLost(f"fleet {self.lease.fleet} forgot run {self.lease.run} ({self.lease.lost}): its "
                                 "adapters are unloaded, so the run stops")
        new = ray.get(self.metrics.get_rows.remote(len(self.rows)))
        if new:
            self._last_progress = self._last_note = time.monotonic()
            self.placement.reset()
            starts = ray.get(self.buffer.starts.remote())
            self._starts_at_step, self._worker_starts_at_step = starts["train"], starts["rollout"]
        else:
            self.placement.check(self.last_step)
            self._watch()
        for row in new:
            self.rows.append(row)
            if isinstance(row.get("publish_seconds"), (int, float)):
                self._sync_s = row["publish_seconds"]
            self.bar.update(1)
            self.bar.set_postfix_str(
                f"reward={row.get('reward_mean', float('nan')):.3f} ver={row.get('version', 0)} "
                f"stale={row.get('staleness_mean', 0):.2f} tok/s={row.get('gen_tokens_per_s', 0):.0f} "
                f"sync={'-' if self._sync_s is None else f'{1e3 * self._sync_s:.0f}ms'}", refresh=False)
            self._warn_counts(row)
            if self.evals is not None:
                self.evals.on_step(row)
            if row["step"] % self.log_every == 0:
                logger.info(self.summary_line(row))
        if self.evals is not None:
            self.evals.poll()
        if time.monotonic() - self._last_stats > INGRESS_STATS_EVERY_S:
            self._last_stats = time.monotonic()
            try:
                stats = self.ingress.stats.remote().result(timeout_s=10)
                ray.get(self.metrics.set_extra.remote(ingress_row_metrics(stats)))
                self._watch_replicas(stats)
            except Exception as e:  # stats are advisory; never stop training for them
                logger.debug("ingress stats failed: %s", e)

    def summary_line(self, row: dict) -> str:
        """One line per run.log_every steps: the last log_every steps' reward, the latest eval, staleness,
        dropped samples, throughput and sync latency."""
        last = self.rows[-self.log_every:]
        rew = [x["reward_mean"] for x in last if isinstance(x.get("reward_mean"), (int, float))]
        tps = [x["gen_tokens_per_s"] for x in last if isinstance(x.get("gen_tokens_per_s"), (int, float))]
        pub = [x["publish_seconds"] for x in last if isinstance(x.get("publish_seconds"), (int, float))]
        parts = [f"step {row['step']}/{self.bar.total}", f"reward {sum(rew) / len(rew):.3f}" if rew else "reward -"]
        ev = self.evals.latest if self.evals is not None else None
        if ev:
            parts.append(f"eval acc {ev['eval/accuracy']:.3f} (v{ev['eval/version']})")
        parts += [f"version {row.get('version', 0)}", f"staleness {row.get('staleness_mean', 0):.2f}",
                  f"dropped {row.get('dropped_samples', 0)}",
                  f"gen {sum(tps) / len(tps):.0f} tok/s" if tps else "gen - tok/s",
                  f"sync {1e3 * sorted(pub)[len(pub) // 2]:.0f} ms" if pub else "sync -"]
        if "partial_resumed" in row:  # rollout.partial
            moved = sum(x.get("partial_resumed", 0) for x in last)
            parts.append(f"moved {moved} ({row['versions_per_sample_mean']:.2f} versions/sample)")
        if "episode_turns_mean" in row:  # multi-turn runs
            hits = " ".join(f"{row[k]:.2f}" for k in sorted(k for k in row if k.startswith("prefix_hit_turn")))
            parts.append(f"turns {row['episode_turns_mean']:.2f} (truncated {row['episode_truncated']}) "
                         f"tools {row['tool_calls_mean']:.2f}/ep, {row['tool_errors']} err | env errors "
                         f"{row.get('env_errors', 0)} | env tokens {100 * row['env_tokens_fraction']:.0f}% | "
                         f"prefix hit/turn {hits}")
        return " | ".join(parts)

    def _warn_counts(self, row: dict) -> None:
        """Counters that need a human the first time they move (then they ride on the summary lines)."""
        for key, what in (("dropped_samples", "samples dropped as too stale (sync.max_staleness)"),
                          ("rollout_failed_groups", "rollout groups failed after retries (replicas lost?)"),
                          ("rollout_retries", "rollout groups retried after a lost replica/ingress"),
                          ("version_mismatches", "served-version mismatches: samples from the wrong weights")):
            value = row.get(key)
            if isinstance(value, (int, float)) and value > self._warned.get(key, 0) and (
                    key not in self._warned or value >= 2 * self._warned[key]):
                logger.warning("step %d: %s %s so far", row["step"], int(value), what)
                self._warned[key] = value

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
        # A crash-looping trainer is seen within seconds (one actor call); the stall bookkeeping and its
        # log line keep their slower pace.
        if now - self._last_restart_check < RESTART_CHECK_S:
            return
        self._last_restart_check = now
        buf = ray.get(self.buffer.stats.remote())
        self._check_restarts(buf)
        if now - self._last_note < min(30.0, self.stall_timeout / 3):
            return
        self._last_note = now
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

    def _check_restarts(self, buf: dict) -> None:
        """Ray Train restarts the worker group after any failure (train_loops/trainer.py); more than
        train.max_restarts restarts since the last logged step (or since the start) is a crash that comes back
        every time: the run ends with one line. The same rule holds for each rollout worker (Ray restarts
        one without limit; rollout.max_restarts)."""
        since = _restarts_since(buf.get("trainer_starts", 0), self._starts_at_step)
        if since > self.max_restarts:
            self._restarts_error(f"the train worker group restarted {_times(since)}", f"train.max_restarts="
                                 f"{self.max_restarts}")
        for worker, n in sorted((buf.get("rollout_starts") or {}).items()):
            since = _restarts_since(n, self._worker_starts_at_step.get(worker))
            if since > self.max_worker_restarts:
                self._restarts_error(f"rollout worker {worker} restarted {_times(since)}",
                                     f"rollout.max_restarts={self.max_worker_restarts}")

    def _restarts_error(self, what: str, limit: str) -> None:
        raise RestartsError(
            f"{what} without logging a step ({limit}); last step {self.last_step}; the workers' errors are in the "
            f"run's logs/ray; python -m app train --resume RUN_DIR continues from the newest checkpoint once the "
            f"cause is fixed")

    def _ongoing(self) -> int:
        try:
            stats = self.ingress.stats.remote().result(timeout_s=10)
        except Exception:  # an unreachable ingress is not proof of generation
            return 0
        return sum(int(r.get("ongoing", 0)) for r in stats.get("replicas", []))

    def _replica_state(self) -> list:
        try:
            stats = self.ingress.stats.remote().result(timeout_s=10)
        except Exception as e:
            return [f"ingress unreachable: {e}"]
        return [{k: r.get(k) for k in ("replica_id", "ongoing", "versions")} for r in stats.get("replicas", [])] + \
            [f"error: {e}" for e in stats.get("replica_errors", [])]

    def close(self) -> None:
        self.bar.close()


class CtrlC:
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


@dataclass
class TrainOutcome:
    """How `trainer.fit()` ended: its ray.train.Result, or the exception it raised; `interrupted`: a
    Ctrl-C asked it to stop early."""

    result: Any
    interrupted: bool

    @property
    def raised(self) -> bool:
        return isinstance(self.result, BaseException)

    @property
    def stopped_cleanly(self) -> bool:
        """fit returned without an error (a Ctrl-C stop ends this way, after its checkpoint)."""
        return not self.raised and self.result.error is None

    def checked_result(self):
        """The Result of a fit that succeeded; what it raised, or RuntimeError for a failed one."""
        if self.raised:
            raise self.result
        if self.result.error is not None:
            raise RuntimeError(f"training failed: {self.result.error}")
        return self.result


def train_and_watch(trainer, progress: Progress, buffer, worker_runs: list) -> TrainOutcome:
    """`trainer.fit()` in a thread; the driver's thread polls `progress` every second (StallError ends
    the run), fails it when a rollout worker dies, and handles Ctrl-C. Afterwards the buffer closes: the
    workers stop sampling. On UnplaceableError or RestartsError Ray Train's controller is ended first: its fit
    waits for a placement that cannot come, or restarts the crashing group again, and would not see the closed
    buffer."""
    import ray

    from app.placement_watch import abort_train_controller

    outcome: dict = {}
    fit = threading.Thread(target=lambda: outcome.update(result=_fit(trainer)), name=FIT_THREAD, daemon=True)
    fit.start()
    try:
        with CtrlC(buffer) as ctrl_c:
            while fit.is_alive():
                fit.join(timeout=1.0)
                progress.poll()
                _raise_worker_errors(worker_runs)
            progress.poll()
            interrupted = ctrl_c.count > 0
    except (UnplaceableError, RestartsError):
        abort_train_controller()
        raise
    finally:
        progress.close()
        ray.get(buffer.close.remote())
        # A run that failed outside the trainer: the closed buffer ends its loop (no restarts), and the
        # driver waits for it, so no thread is inside Ray when the caller tears Ray down.
        fit.join(timeout=FIT_STOP_TIMEOUT_S)
        if fit.is_alive():
            logger.warning("the trainer did not stop within %.0fs of the run ending", FIT_STOP_TIMEOUT_S)
    return TrainOutcome(outcome.get("result"), interrupted)


def _times(n: int) -> str:
    return "once" if n == 1 else f"{n} times"


def _restarts_since(starts: int, at_last_step: int | None) -> int:
    """Restarts since the last logged step; before any step, since the first start (which is no restart)."""
    return starts - (at_last_step if at_last_step is not None else min(starts, 1))


def _fit(trainer):
    try:
        return trainer.fit()
    except BaseException as e:  # surfaced in the driver thread
        return e


def _raise_worker_errors(worker_runs: list) -> None:
    """A rollout worker that died (bad reward function, ingress error) fails the run loudly."""
    import ray

    done, _ = ray.wait(worker_runs, num_returns=len(worker_runs), timeout=0)
    for ref in done:
        ray.get(ref)  # raises the worker's exception; a clean return means data ran out
