"""Node loss and a run the cluster can no longer place, on CPU with the real pipeline: a local
cluster (a head with no CPU holding the driver and the run's own actors, three 2-CPU worker nodes), `python -m
app train` as a subprocess joining it. The node of a replica and then the node of a train worker are removed
and survived; once a step after a checkpoint was logged the last worker node goes, and the driver stops within
run.placement_timeout_s plus a bound, exit 1, with one line naming what waits and the checkpoint; once a node
is added again `--resume RUN_DIR` trains the remaining steps: metrics.jsonl has steps 1..N exactly once and no
prompt is lost, doubled or skipped. Also: a service start that no node can hold ends with the same line, and
(without Ray) which actor records count as waiting."""
from __future__ import annotations

import json
import time

import pytest

from common.data_accounting import data_accounting
from tests._serve_helpers import free_port
from tests.test_resume import _checkpoint_steps, _end_group, _rows, _run_to_exit, _start, _wait_for

STEPS, PROMPTS, PER_STEP, GROUP = 14, 56, 4, 4  # one epoch
PLACEMENT_TIMEOUT_S = 10
# Ray notices a removed node within seconds (FAST_HEALTH), then Ray Train asks for a new worker group; the
# driver looks every few seconds and tears down (Serve app, actors) after the timeout.
EXIT_BOUND_S = PLACEMENT_TIMEOUT_S + 90
NODE_CPUS = 2  # the run fits one node: a replica (0.4), the ingress (0.1), a train worker (0.4), a rollout worker


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


# Ray's node health checks, faster than the defaults (5 failures 3 s apart) so a removed node is noticed in
# seconds: the test waits on that three times.
FAST_HEALTH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 1000,
               "health_check_failure_threshold": 3}


@pytest.fixture
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                      "_system_config": FAST_HEALTH})
    for _ in range(3):
        c.add_node(num_cpus=NODE_CPUS)
    c.wait_for_nodes()
    yield c
    for node in list(c.worker_nodes):
        _remove_node(c, node)
    c.shutdown()


def _remove_node(cluster, node) -> None:
    """`cluster.remove_node`, and the worker processes of that node with it. Ray ends the node's raylet and its
    workers exit when they notice; a vLLM replica's engine process does not watch its parent, and two outlived
    their raylets by 8 minutes on this machine (2026-12-07, ~1.7 GB each) until serve_deployments/engine_reaper.py:
    the engines must now end by themselves. The rest are this test's own processes, found as the raylet's
    descendants before it goes, and ended if they linger."""
    import psutil
    from ray._private import ray_constants

    from tests.support.processes import is_engine, left_after

    raylet = psutil.Process(node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid)
    workers = raylet.children(recursive=True)
    cluster.remove_node(node, allow_graceful=False)
    assert left_after([w for w in workers if is_engine(w)], 60) == []
    left_after(workers, 15)


def _node_holding(cluster, cls: str):
    """The worker node (of those left) where a live actor of class `cls` runs, from the GCS's actor table."""
    from common.ray_utils import actors_by_node

    held = actors_by_node()
    node = next((n for n in cluster.worker_nodes if any(cls in c for c in held.get(n.node_id, []))), None)
    assert node is not None, f"no worker node holds a {cls}: {held}"
    return node


@pytest.mark.slow
def test_nodes_lost_then_unplaceable_stops_with_a_checkpoint_and_resumes(cluster, tiny_model_dir, tmp_path):
    """The whole multi-node story in one run (a head without CPU holding the driver and the run's own actors,
    three 2-CPU worker nodes; one replica, one rollout worker, one train worker):
    1. the node of a vLLM replica is removed, then the node of a train worker: the run goes on (steps after
       each), on the node left;
    2. once a step after a checkpoint was logged the last worker node goes: Ray Train's worker group and the
       replicas have nowhere to go, and the driver stops within run.placement_timeout_s plus a bound, exit 1,
       with one line naming what waits and the checkpoint;
    3. a node is added again and `--resume RUN_DIR` trains the remaining steps: metrics.jsonl has steps 1..N
       exactly once and no prompt is lost, doubled or skipped across the two processes and three node losses."""
    import ray

    out, name = tmp_path / "runs", "unplaceable"
    run_dir = out / name
    sets = [f"model.path={tiny_model_dir}", "model.build_tiny=false", f"run.out_dir={out}", f"run.name={name}",
            f"run.ray_address={cluster.address}", f"train.total_steps={STEPS}", "checkpoint.every=2",
            f"data.builtin_size={PROMPTS}", f"grpo.prompts_per_step={PER_STEP}", f"grpo.group_size={GROUP}",
            "grpo.max_new_tokens=8", "eval.path=null", f"rollout.http_port={free_port()}",
            "rollout.replicas=1", "train.num_workers=1", "rollout.workers=1",  # each start costs less on 2 cores
            "rollout.proxy_location=HeadOnly",  # the nodes share one machine's ports
            "run.log_every=1", "run.stall_timeout_s=600", f"run.placement_timeout_s={PLACEMENT_TIMEOUT_S}"]
    cli = ["--config", "recipes/tiny-cpu.yaml", *[a for s in sets for a in ("--set", s)]]
    log1 = tmp_path / "run1.log"
    ray.init(address=cluster.address, log_to_driver=False)  # the test reads the actor table; its own job
    p = _start(cli, log1)
    try:
        last = lambda: max((r["step"] for r in _rows(run_dir)), default=0)  # noqa: E731
        # 1. a replica's node, then a train worker's: each survived once a later step is logged
        for cls in ("RolloutReplica", "RayTrainWorker"):
            _wait_for(p, log1, lambda: last() >= 2, "a step")
            node = _node_holding(cluster, cls)
            at = last()
            _remove_node(cluster, node)
            _wait_for(p, log1, lambda at=at: last() > at + 1, f"a step after losing the node of a {cls}")
        # 2. the last worker node goes once a step after a checkpoint was logged: nothing can be placed
        _wait_for(p, log1, lambda: _checkpoint_steps(run_dir) and last() > max(_checkpoint_steps(run_dir)),
                  "a step after a checkpoint")
        for node in list(cluster.worker_nodes):
            _remove_node(cluster, node)
        removed = time.monotonic()
        rc = p.wait(timeout=EXIT_BOUND_S + 120)
        stopped_after = time.monotonic() - removed
    finally:
        _end_group(p)
        ray.shutdown()
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
    # 3. a node is back: --resume trains the rest on it
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


@pytest.mark.slow
def test_service_start_that_no_node_can_hold_ends_with_one_line(tiny_model_dir, tmp_path):
    """`serve.run` waits without a bound while a replica has no node: the run's service start deploys
    without waiting and gives up after run.placement_timeout_s with the line that names what waits."""
    import ray
    from ray import serve

    from app.placement_watch import UnplaceableError
    from app.service import start_rollout_service
    from common.registry import get_or_create_registry
    from tests._serve_helpers import small_config

    cfg = small_config(tiny_model_dir, cpus_per_replica=2.0, http_port=free_port(), app_name="unplaceable-start")
    cfg = cfg.replace(run={"placement_timeout_s": 3, "out_dir": str(tmp_path)})
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        registry = get_or_create_registry()
        t0 = time.monotonic()
        with pytest.raises(UnplaceableError) as err:
            start_rollout_service(cfg, registry)
        waited = time.monotonic() - t0
        line = str(err.value)
        assert "Serve's 1 RolloutReplica replica needs {CPU: 2}, 0 of 1 running" in line, line
        assert "the cluster has {CPU:" in line and "free of {CPU: 1}" in line, line
        assert "run.placement_timeout_s" in line and "start the run again" in line, line
        assert waited < 60, waited
    finally:
        serve.shutdown()
        ray.shutdown()
