"""Experiment trackers (app/loggers.py): what they write is readable by TensorBoard's and MLflow's own
readers, every numeric metric under its metrics.jsonl name at its row's step. No Ray except the last test."""
import importlib.util
import json
import math

import pytest

from app import loggers as L
from common import config as C

ROWS = [{"step": s, "time": 1_700_000_000.0 + s, "reward_mean": 0.25 * s, "kl": 0.01 * s, "published": True,
         "eval/accuracy": 0.5 + 0.1 * s, "staleness_max": s % 2, "note": "text is jsonl only"} for s in (1, 2, 3)]


def _log_all(lgs):
    for r in ROWS:
        for lg in lgs:
            lg.log(r["step"], r)
    for lg in lgs:
        lg.close()


def _tb_scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _expected():
    out = {}
    for r in ROWS:
        for k, v in L.numeric(r).items():
            out.setdefault(k, []).append((r["step"], v))
    return out


def test_numeric_keeps_numbers_and_bools_but_not_step_or_text():
    assert L.numeric(ROWS[0]) == {"time": 1_700_000_001.0, "reward_mean": 0.25, "kl": 0.01, "published": 1.0,
                                  "eval/accuracy": 0.6, "staleness_max": 1.0}


def test_tensorboard_event_files_hold_every_metric(tmp_path):
    lgs = L.make_loggers(tmp_path, "t", loggers=["tensorboard"])
    assert [type(x).__name__ for x in lgs] == ["JsonlLogger", "TensorBoardLogger"]
    _log_all(lgs)
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    got = _tb_scalars(tmp_path / "tensorboard")
    exp = _expected()
    assert set(got) == set(exp)
    for k, pts in exp.items():
        if k == "time":  # event files store float32
            continue
        assert [s for s, _ in got[k]] == [s for s, _ in pts]
        assert [v for _, v in got[k]] == pytest.approx([v for _, v in pts], rel=1e-6)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == ROWS  # jsonl: the rows as given, text included


def test_mlflow_file_store_readable_by_client(tmp_path):
    from mlflow.tracking import MlflowClient

    lgs = L.make_loggers(tmp_path, "run-a", loggers=["jsonl", "mlflow"], project="proj",
                         config={"grpo": {"lr": 0.001}, "run": {"name": "run-a"}})
    _log_all(lgs)
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name("proj")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "run-a" and run.info.status == "FINISHED"
    assert run.data.params["grpo.lr"] == "0.001"
    for k, pts in _expected().items():
        hist = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, k))
        assert [s for s, _ in hist] == [s for s, _ in pts], k
        assert [v for _, v in hist] == pytest.approx([v for _, v in pts]), k


def test_mlflow_tracking_uri_is_used(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "elsewhere").resolve().as_uri()
    _log_all(L.make_loggers(tmp_path / "run", "r", loggers=["mlflow"], mlflow_tracking_uri=uri))
    assert not (tmp_path / "run" / "mlruns").exists()
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("lora-grpo").experiment_id])
    assert [m.value for m in client.get_metric_history(run.info.run_id, "reward_mean")] == [0.25, 0.5, 0.75]


def test_non_finite_values_do_not_break_mlflow(tmp_path):
    lgs = L.make_loggers(tmp_path, "r", loggers=["mlflow", "tensorboard"])
    for lg in lgs:
        lg.log(1, {"step": 1, "reward_mean": math.nan, "kl": 0.5})
        lg.close()


def test_unknown_and_missing_loggers_are_named():
    with pytest.raises(ValueError, match="unknown logger"):
        L.make_loggers("/tmp/unused-never-written", loggers=["neptune"])
    with pytest.raises(C.ConfigError, match=r"run.loggers\[0\]: 'neptune' is not one of jsonl, tensorboard"):
        C.load(None, ["run.loggers=[neptune]"])
    cfg = C.load(None, ["run.loggers=[jsonl, tensorboard, mlflow]"])
    assert L.tracking_options(cfg)["loggers"] == ["jsonl", "tensorboard", "mlflow"]


def test_missing_wandb_fails_validation_naming_package_and_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(C.ConfigError, match=r"run.loggers: wandb needs the `wandb` package.*\.\[wandb\]"):
        C.load(None, ["run.loggers=[wandb]"])
    assert C.missing_loggers(["jsonl", "wandb"]) == [
        "run.loggers: wandb needs the `wandb` package, which is not installed: "
        "pip install -e '.[wandb]' (or pip install wandb)"]


def test_run_metrics_actor_class_feeds_the_trackers(tmp_path):
    """RunMetrics's own code (the undecorated class, no Ray cluster): rows reach metrics.jsonl and
    TensorBoard, and close() finishes the MLflow run."""
    from app.metrics import RunMetrics

    cls = RunMetrics.__ray_actor_class__
    m = cls(str(tmp_path), "r", tracking={"loggers": ["tensorboard", "mlflow"], "project": "p"})
    m._gauge = lambda key: type("G", (), {"set": lambda *a, **k: None})()  # no Ray metrics agent here
    m.log_rollout(100, 2.0, 0.5)
    m.log_train(1, {"reward_mean": 0.5, "kl": 0.0})
    m.log_train(2, {"reward_mean": 0.75, "kl": 0.1})
    m.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["gen_groups"] == 1
    tb = _tb_scalars(tmp_path / "tensorboard")
    assert tb["reward_mean"] == [(1, 0.5), (2, 0.75)] and "gen_tokens_per_s" in tb
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("p").experiment_id])
    assert run.info.status == "FINISHED"
    assert [m.value for m in client.get_metric_history(run.info.run_id, "kl")] == [0.0, 0.1]


def test_wandb_offline_run_is_written_when_installed(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    _log_all(L.make_loggers(tmp_path, "r", loggers=["wandb"]))
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    assert list(run_dir.glob("run-*.wandb"))
