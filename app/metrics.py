"""Run metrics: one actor the trainer, workers and driver report to. It writes `metrics.jsonl` and the
configured trackers (`run.loggers`: TensorBoard, MLflow, W&B; see app/loggers.py), exports gauges through
`ray.util.metrics` (Ray dashboard / Prometheus), and keeps the rows for the driver."""
from __future__ import annotations

import logging
import time
from pathlib import Path

import ray

from common.names import METRICS_NAME  # noqa: F401  (the actor is created under it)

logger = logging.getLogger("app.metrics")


@ray.remote(num_cpus=0)
class RunMetrics:
    def __init__(self, run_dir: str, run_name: str = "grpo", tracking: dict | None = None,
                 resume_step: int | None = None):
        """`tracking`: `app.loggers.tracking_options(cfg)` (loggers, mlflow_tracking_uri, project, config);
        None = metrics.jsonl only. `resume_step`: a resumed run continues metrics.jsonl after this step
        (see `resume_rows`)."""
        from app.loggers import make_loggers

        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict] = resume_rows(self.path, resume_step) if resume_step is not None else []
        self.loggers = make_loggers(run_dir, run_name, **(tracking or {}))
        self._closed = False
        self.run_name = run_name
        self._gauges: dict = {}
        self._gen = {"tokens": 0, "seconds": 0.0, "groups": 0, "reward_sum": 0.0}
        self._task_reward: dict[str, list] = {}  # data task -> [reward sum, groups] since the last row
        self._extra: dict = {}
        self._judge: dict | None = None  # a judge's work since the last row (log_judge); None: no judge
        self._t_last = time.time()

    def _gauge(self, key: str):
        from ray.util.metrics import Gauge

        if key not in self._gauges:
            name = "lora_grpo_" + "".join(c if c.isalnum() else "_" for c in key)
            self._gauges[key] = Gauge(name, description=f"lora-grpo {key}", tag_keys=("run",))
        return self._gauges[key]

    def log_rollout(self, tokens: int, seconds: float, reward_mean: float, task: str | None = None) -> None:
        """One call per scored group (from the rollout workers); folded into the next step's row. `task`: the
        row's data task (reasoning-gym), whose groups' mean reward the row carries as `reward/TASK`."""
        self._gen["tokens"] += tokens
        self._gen["seconds"] += seconds
        self._gen["groups"] += 1
        self._gen["reward_sum"] += reward_mean
        if task:
            acc = self._task_reward.setdefault(task, [0.0, 0])
            acc[0] += reward_mean
            acc[1] += 1

    def log_filtered_group(self, tokens: int = 0, seconds: float = 0.0) -> None:
        """A group dynamic sampling dropped (all rewards equal): its generation still counts toward the
        throughput; the running total `filtered_groups` rides on the following rows."""
        self._gen["tokens"] += tokens
        self._gen["seconds"] += seconds
        self._extra["filtered_groups"] = self._extra.get("filtered_groups", 0) + 1

    def log_judge(self, stats: dict) -> None:
        """One group's judging (app/judge.JudgeStats, from the rollout workers): the counts are running totals
        (judge_calls, judge_parse_failures, judge_timeouts, judge_errors); the rows since the last carry
        judge_seconds (the groups' judging wall time) and reward_judge (the mean judge score). {} makes the
        keys appear."""
        for key in ("calls", "parse_failures", "timeouts", "errors"):
            self._extra[f"judge_{key}"] = self._extra.get(f"judge_{key}", 0) + int(stats.get(key, 0))
        judge = self._judge = self._judge or {"seconds": 0.0, "score_sum": 0.0, "calls": 0}
        judge["seconds"] += float(stats.get("seconds", 0.0))
        judge["score_sum"] += float(stats.get("score_sum", 0.0))
        judge["calls"] += int(stats.get("calls", 0))

    def _judge_row(self) -> dict:
        judge = self._judge
        if judge is None:
            return {}
        self._judge = {"seconds": 0.0, "score_sum": 0.0, "calls": 0}
        return {"judge_seconds": judge["seconds"],
                "reward_judge": judge["score_sum"] / judge["calls"] if judge["calls"] else None}

    def add_count(self, key: str, n: int = 1) -> None:
        """A running total reported as it happens (e.g. the rollout workers' `version_mismatches`, which
        must stay 0); it rides on the following rows. n=0 makes the key appear."""
        self._extra[key] = self._extra.get(key, 0) + int(n)

    def set_extra(self, values: dict) -> None:
        """Values the driver polls (router and engine stats), attached to the following rows."""
        self._extra.update(values)

    def log_eval(self, step: int, values: dict) -> None:
        """An evaluation's `eval/*` metrics (app/evaluate.py) for `step`: attached to the next step row only
        (with eval/step, the step it scored), not to every following one; `flush_eval` puts a result that
        no later row will carry on the last row."""
        self._eval = {**{k: v for k, v in values.items() if k.startswith("eval/")}, "eval/step": int(step)}
        for k, v in self._eval.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self._gauge(k).set(float(v), tags={"run": self.run_name})

    def flush_eval(self) -> None:
        """A pending eval result (the final step's) joins the last row: in memory, as metrics.jsonl's last
        line (rewritten in place) and in the trackers at that row's step."""
        pending = getattr(self, "_eval", None)
        if not pending or not self.rows:
            return
        self._eval = None
        row = self.rows[-1]
        row.update(pending)
        lines = self.path.read_text().splitlines() if self.path.is_file() else []
        if lines:
            import json

            lines[-1] = json.dumps(row, default=float)
            self.path.write_text("\n".join(lines) + "\n")
        for lg in self.loggers[1:]:
            try:
                lg.log(row["step"], pending)
            except Exception as e:
                logger.warning("%s failed at step %d: %s", type(lg).__name__, row["step"], e)

    def log_train(self, step: int, metrics: dict) -> None:
        """One row per optimizer step (from the trainer's rank 0). A step logged again (Ray Train restored
        the workers from an earlier checkpoint and replays steps) replaces its row and those after it,
        so metrics.jsonl holds each step once."""
        if self.rows and int(step) <= self.rows[-1]["step"]:
            self.rows = [r for r in self.rows if r["step"] < int(step)]
            resume_rows(self.path, int(step) - 1)
        now = time.time()
        gen = self._gen
        ev, self._eval = getattr(self, "_eval", None) or {}, None
        row = {"step": int(step), "time": now, **metrics, **self._extra, **self._judge_row(), **ev,
               "gen_groups": gen["groups"], "gen_seconds_sum": gen["seconds"],
               # reward of the groups generated since the last row (the batch's own is reward_mean)
               "gen_reward_mean": gen["reward_sum"] / gen["groups"] if gen["groups"] else None,
               # wall-clock rate: generation runs concurrently across workers and replicas
               "gen_tokens_per_s": gen["tokens"] / max(1e-9, now - self._t_last),
               **{f"reward/{task}": total / n for task, (total, n) in sorted(self._task_reward.items())}}
        self._task_reward = {}
        self._gen = {"tokens": 0, "seconds": 0.0, "groups": 0, "reward_sum": 0.0}
        self._t_last = now
        self.rows.append(row)
        self.loggers[0].log(row["step"], row)  # metrics.jsonl
        for lg in self.loggers[1:]:
            try:
                lg.log(row["step"], row)
            except Exception as e:  # a tracker's hiccup never stops training
                logger.warning("%s failed at step %d: %s", type(lg).__name__, row["step"], e)
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self._gauge(k).set(float(v), tags={"run": self.run_name})

    def get_rows(self, since: int = 0) -> list[dict]:
        return self.rows[since:]

    def close(self, status: str = "FINISHED") -> None:
        """Flush and finish every tracker (MLflow run status FINISHED or FAILED); idempotent. Call it
        before killing the actor: ray.kill runs no finaliser."""
        if self._closed:
            return
        self._closed = True
        for lg in self.loggers:
            try:
                if hasattr(lg, "status"):
                    lg.status = status
                lg.close()
            except Exception as e:
                logger.warning("closing %s failed: %s", type(lg).__name__, e)


def resume_rows(path: Path, step: int) -> list[dict]:
    """A resumed run's metrics.jsonl: the rows of steps 1..`step` (the checkpoint's), one per step (the
    last written, as a Ray Train restore logs replayed steps again), rewritten in place; rows of later
    steps (written before a kill, their steps lost) and a torn last line are dropped."""
    import json

    by_step: dict[int, dict] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut short by the kill
            if isinstance(row, dict) and isinstance(row.get("step"), int) and 1 <= row["step"] <= step:
                by_step[row["step"]] = row
    rows = [by_step[s] for s in sorted(by_step)]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r, default=float) + "\n" for r in rows))
    tmp.replace(path)
    return rows
