"""Experiment tracking backends behind one tiny interface: `log(step, row)` and `close()`.

`jsonl` (always on) writes each row as is to `RUN_DIR/metrics.jsonl`. The others get every numeric value
of the row (bools as 0/1; `step` is the x axis, not a series) under the same name, at the row's step:

- `tensorboard`: event files in `RUN_DIR/tensorboard/` (torch.utils.tensorboard, else tensorboardX);
- `mlflow`: a run in `run.mlflow_tracking_uri`, by default the file store `RUN_DIR/mlruns`
  (experiment `run.tracking_project`, run name `run.name`, the config as params);
- `wandb`: a run in project `run.tracking_project`, files in `RUN_DIR/wandb/`, offline unless
  `WANDB_API_KEY` is set (or `WANDB_MODE` says otherwise).

Install the optional ones with `pip install -e '.[tracking]'` (tensorboard, mlflow-skinny) or
`'.[wandb]'`. A missing one fails config validation (common.config.missing_loggers, whose message a
backend that cannot import repeats).
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Protocol

from common.config import LOGGER_PACKAGES, missing_loggers

LOGGER_NAMES = tuple(LOGGER_PACKAGES)


class Logger(Protocol):
    def log(self, step: int, row: dict) -> None: ...

    def close(self) -> None: ...


def numeric(row: dict) -> dict[str, float]:
    """The row's numeric values by name (bools as 0/1), without `step`."""
    return {k: float(v) for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, complex)}


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


class JsonlLogger:
    """One JSON object per line; the row exactly as given (non-numeric values too)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, step: int, row: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": int(step), **row}, default=float) + "\n")

    def close(self) -> None:
        pass


class TensorBoardLogger:
    def __init__(self, log_dir: str | Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            try:
                from tensorboardX import SummaryWriter
            except ImportError as e:
                raise ImportError(missing_loggers(["tensorboard"])[0]) from e
        self.log_dir = Path(log_dir)
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, step: int, row: dict) -> None:
        for k, v in numeric(row).items():
            self.writer.add_scalar(k, v, global_step=int(step))
        self.writer.flush()  # one row per optimizer step: cheap, and a running run is readable

    def close(self) -> None:
        self.writer.close()


class MlflowLogger:
    status = "FINISHED"  # the run's end state at close(); RunMetrics.close sets FAILED for a failed run

    def __init__(self, tracking_uri: str, experiment: str, run_name: str, params: dict | None = None):
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as e:
            raise ImportError(missing_loggers(["mlflow"])[0]) from e
        if tracking_uri.startswith("file:") or "://" not in tracking_uri:
            # MLflow 3 keeps the file store in maintenance mode behind this switch; it is the backend
            # that needs no database packages (mlflow-skinny ships no SQLAlchemy).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=tracking_uri)
        exp = self.client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        if params:
            from mlflow.entities import Param

            items = [Param(k, str(v)[:6000]) for k, v in flatten(params).items()]
            for i in range(0, len(items), 100):  # log_batch takes at most 100 params per call
                self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log(self, step: int, row: dict) -> None:
        import time

        from mlflow.entities import Metric

        ts = int(1000 * row.get("time", time.time()))
        ms = [Metric(k, v, ts, int(step)) for k, v in numeric(row).items() if math.isfinite(v)]
        for i in range(0, len(ms), 1000):  # log_batch's metric limit
            self.client.log_batch(self.run_id, metrics=ms[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id, status=self.status)


class WandbLogger:
    def __init__(self, run_dir: str | Path, project: str, run_name: str, config: dict | None = None):
        try:
            import wandb
        except ImportError as e:
            raise ImportError(missing_loggers(["wandb"])[0]) from e
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.run = wandb.init(project=project, name=run_name, dir=str(run_dir), mode=mode, config=config or {},
                              settings=wandb.Settings(silent=True),  # the console belongs to the progress bar
                              reinit="create_new")

    def log(self, step: int, row: dict) -> None:
        self.run.log(numeric(row), step=int(step))

    def close(self) -> None:
        self.run.finish()


def make_loggers(run_dir: str | Path, run_name: str = "grpo", loggers: list[str] | None = None,
                 mlflow_tracking_uri: str | None = None, project: str = "lora-grpo",
                 config: dict | None = None) -> list[Logger]:
    """The jsonl logger plus one per requested backend (unknown names raise ValueError)."""
    run_dir = Path(run_dir)
    names = [n for n in dict.fromkeys(loggers or []) if n != "jsonl"]
    bad = [n for n in names if n not in LOGGER_NAMES]
    if bad:
        raise ValueError(f"run.loggers: unknown logger(s) {bad} (known: {', '.join(LOGGER_NAMES)})")
    out: list[Logger] = [JsonlLogger(run_dir / "metrics.jsonl")]
    for name in names:
        if name == "tensorboard":
            out.append(TensorBoardLogger(run_dir / "tensorboard"))
        elif name == "mlflow":
            uri = mlflow_tracking_uri or (run_dir / "mlruns").resolve().as_uri()
            out.append(MlflowLogger(uri, project, run_name, params=config))
        elif name == "wandb":
            out.append(WandbLogger(run_dir, project, run_name, config=config))
    return out


def tracking_options(cfg) -> dict:
    """What `RunMetrics(..., tracking=...)` needs from a Config."""
    return {"loggers": list(cfg.run.loggers), "mlflow_tracking_uri": cfg.run.mlflow_tracking_uri,
            "project": cfg.run.tracking_project, "config": cfg.to_dict()}
