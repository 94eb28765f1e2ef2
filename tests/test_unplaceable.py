"""A run the cluster can no longer place (issue 22), on CPU with the real pipeline: a local cluster (a head with
no CPU, as a head that only coordinates, and one worker node), `python -m app train` as a subprocess joining
it. Once a step after a checkpoint was logged the worker node is removed: Ray Train's worker group and the Serve
replicas have nowhere to go. The driver stops within run.placement_timeout_s plus a bound, exit 1, with one
line naming what waits and the checkpoint; once a node is added again `--resume RUN_DIR` trains the remaining
steps: metrics.jsonl has steps 1..N exactly once and no prompt is lost, doubled or skipped. Plus, without
Ray: which actor records count as waiting, and the line's wording."""
from __future__ import annotations

import json
import time

import pytest

from benchmarks.bench_reliability import data_accounting
from tests._serve_helpers import free_port
from tests.test_resume import _checkpoint_steps, _end_group, _rows, _run_to_exit, _start, _wait_for

STEPS, PROMPTS, PER_STEP, GROUP = 10, 40, 4, 4  # one epoch
PLACEMENT_TIMEOUT_S = 10
# Ray notices a removed node within ~30 s (health checks), then Ray Train asks for a new worker group; the
# driver looks every few seconds and tears down (Serve app, actors) after the timeout.
EXIT_BOUND_S = PLACEMENT_TIMEOUT_S + 90
NODE_CPUS = 2  # a replica (0.4), the ingress (0.1) and a train worker (0.4)


def _record(cls: str, state: str = "PENDING_CREATION", port: int = 0, job: str = "01000000", need=None) -> dict:
    from app.placement_watch import WAITING_STATES

    return {"class": cls, "job": job, "state": state, "unplaced": state in WAITING_STATES and not port,
            "need": need or {"CPU": 0.4}}


def test_only_the_runs_unplaced_actors_count():
    from app.placement_watch import actors_waiting

    records = [
        _record("ServeReplica:policy:RolloutReplica", "ALIVE", port=5),
        _record("ServeReplica:policy:RolloutReplica"),  # waits for a node
        _record("ServeReplica:policy:Ingress", port=7),  # placed, still constructing: not waiting
        _record("ServeReplica:other:RolloutReplica"),  # another app's
        _record("RolloutWorker", "RESTARTING", job="02000000", need={"CPU": 1.0}),  # another job's
        _record("RolloutWorker", "RESTARTING", need={"CPU": 1.0}),
    ]
    lines = [w.describe() for w in actors_waiting(records, "policy", "01000000")]
    assert lines == ["Serve's 2 RolloutReplica replicas need {CPU: 0.4} each, 1 of 2 running",
                     "the run's 1 rollout worker needs {CPU: 1}, 0 of 1 placed"]
    assert actors_waiting(records[:1] + records[2:4], "policy", "01000000") == []


@pytest.fixture
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    c.add_node(num_cpus=NODE_CPUS)
    c.wait_for_nodes()
    yield c
    c.shutdown()


@pytest.mark.slow
def test_unplaceable_run_stops_with_a_checkpoint_and_resumes_once_a_node_is_back(cluster, tiny_model_dir,
                                                                                  tmp_path):
    out, name = tmp_path / "runs", "unplaceable"
    run_dir = out / name
    sets = [f"model.path={tiny_model_dir}", "model.build_tiny=false", f"run.out_dir={out}", f"run.name={name}",
            f"run.ray_address={cluster.address}", f"train.total_steps={STEPS}", "checkpoint.every=2",
            f"data.builtin_size={PROMPTS}", f"grpo.prompts_per_step={PER_STEP}", f"grpo.group_size={GROUP}",
            "grpo.max_new_tokens=8", "eval.path=null", "rollout.replicas=1", "train.num_workers=1",
            "rollout.workers=1", f"rollout.http_port={free_port()}", "rollout.proxy_location=HeadOnly",
            "run.log_every=1", "run.stall_timeout_s=600", f"run.placement_timeout_s={PLACEMENT_TIMEOUT_S}"]
    cli = ["--config", "recipes/tiny-cpu.yaml", *[a for s in sets for a in ("--set", s)]]

    # 1. the worker node goes once a step after the first checkpoint was logged: nothing can be placed
    log1 = tmp_path / "run1.log"
    p = _start(cli, log1)
    try:
        _wait_for(p, log1, lambda: _checkpoint_steps(run_dir) and any(
            r["step"] > min(_checkpoint_steps(run_dir)) for r in _rows(run_dir)), "a step after the first checkpoint")
        for node in list(cluster.worker_nodes):
            cluster.remove_node(node, allow_graceful=False)
        removed = time.monotonic()
        rc = p.wait(timeout=EXIT_BOUND_S + 120)
        stopped_after = time.monotonic() - removed
    finally:
        _end_group(p)
    text = log1.read_text()
    assert rc == 1, text[-4000:]
    assert stopped_after < EXIT_BOUND_S, (stopped_after, text[-3000:])
    lines = [line for line in text.splitlines() if "cannot place the run" in line and line.startswith("error:")]
    assert len(lines) == 1, text[-4000:]
    ckpt = max(_checkpoint_steps(run_dir))
    line = lines[0]
    assert "Ray Train's 1 worker needs {CPU: 0.4}" in line or "RolloutReplica replica needs {CPU: 0.4}" in line, line
    assert f"(checkpoint step {ckpt}); add nodes, then python -m app train --resume {run_dir}" in line, line
    assert not (run_dir / "summary.json").exists()

    # 2. a node is back: --resume trains the rest on it
    cluster.add_node(num_cpus=NODE_CPUS)
    cluster.wait_for_nodes()
    log2 = tmp_path / "run2.log"
    rc = _run_to_exit(["--resume", str(run_dir)], log2, timeout=400)
    assert rc == 0, log2.read_text()[-4000:]
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # each step once, none missing
    summary = json.loads((run_dir / "summary.json").read_text())
    data = data_accounting(rows, PROMPTS, PER_STEP, GROUP, STEPS, summary["buffer"]["prompts"]["pending"])
    assert data["groups_trained"] == data["groups_expected"], data
    zero = ("step_rows_duplicated", "step_rows_missing", "samples_lost", "samples_doubled", "prompts_replayed",
            "prompts_skipped")
    assert {k: data[k] for k in zero} == dict.fromkeys(zero, 0), data
