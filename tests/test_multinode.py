"""Placement on a cluster of several nodes (`ray.cluster_utils.Cluster`: one raylet per node on this machine,
as a user's multi-node cluster looks to Ray): the run's own actors (registry, buffer, metrics, evaluator)
live on the driver's node, so losing a worker node never takes the run's state."""
from __future__ import annotations

import pytest

from common import config as C

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    # The head holds no CPU, like a cluster whose head only coordinates; two 1-CPU worker nodes.
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        workers = [c.add_node(num_cpus=1) for _ in range(2)]
        c.wait_for_nodes()
        ray.init(address=c.address, namespace="test-multinode", log_to_driver=False)
        yield c, workers
    finally:
        ray.shutdown()
        c.shutdown()


def _node_of(actor) -> str:
    import ray

    info = ray._private.state.actors(actor._actor_id.hex())  # the GCS's record: needs no dashboard
    return info["Address"]["NodeID"]


def test_the_runs_own_actors_live_on_the_drivers_node(cluster, tiny_model_dir):
    import ray

    from app.eval_schedule import EvalSchedule
    from app.run_actors import start_run_actors
    from common.ray_utils import kill_actor

    c, workers = cluster
    driver_node = ray.get_runtime_context().get_node_id()
    assert driver_node == c.head_node.node_id and driver_node not in {w.node_id for w in workers}
    cfg = C.load(None, [f"model.path={tiny_model_dir}", "eval.path=builtin:letters-heldout", "run.out_dir=/tmp/mn"])
    rows = [{"id": str(i), "prompt": "p", "answer": "a"} for i in range(8)]
    actors = start_run_actors(cfg, rows, None)
    evals = EvalSchedule(cfg, rows[:2], actors.metrics)
    try:
        # a call each: the actor was placed and constructed
        ray.get([actors.registry.live_versions.remote(), actors.buffer.stats.remote()], timeout=120)
        nodes = {name: _node_of(a) for name, a in
                 [("registry", actors.registry), ("metrics", actors.metrics), ("buffer", actors.buffer),
                  ("evaluator", evals.actor)]}
        assert nodes == dict.fromkeys(nodes, driver_node), nodes
    finally:
        for a in (evals.actor, actors.buffer, actors.metrics, actors.registry):
            kill_actor(a)
