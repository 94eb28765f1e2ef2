"""Run metrics: one actor the trainer, workers and driver report to. It writes `metrics.jsonl`, exports
gauges through `ray.util.metrics` (Ray dashboard / Prometheus), and keeps the rows for the driver."""
from __future__ import annotations

import json
import time
from pathlib import Path

import ray

METRICS_NAME = "run-metrics"


@ray.remote(num_cpus=0)
class RunMetrics:
    def __init__(self, run_dir: str, run_name: str = "grpo"):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict] = []
        self.run_name = run_name
        self._gauges: dict = {}

    def _gauge(self, key: str):
        from ray.util.metrics import Gauge

        if key not in self._gauges:
            name = "lora_grpo_" + "".join(c if c.isalnum() else "_" for c in key)
            self._gauges[key] = Gauge(name, description=f"lora-grpo {key}", tag_keys=("run",))
        return self._gauges[key]

    def log_train(self, step: int, metrics: dict) -> None:
        """One row per optimizer step (from the trainer's rank 0)."""
        row = {"step": int(step), "time": time.time(), **metrics}
        self.rows.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row, default=float) + "\n")
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self._gauge(k).set(float(v), tags={"run": self.run_name})

    def get_rows(self, since: int = 0) -> list[dict]:
        return self.rows[since:]
