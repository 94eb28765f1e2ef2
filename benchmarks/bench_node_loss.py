"""Node loss on a local multi-node Ray cluster: the tiny recipe runs on a head (the driver, the run's
own actors, no CPU) and three 2-CPU worker nodes (`ray.cluster_utils.Cluster`: one raylet each, as a real
cluster looks to Ray); whole worker nodes are removed mid-run, then the data accounting is counted as
`bench reliability` counts it.

    python -m app bench node_loss              # ~10 min on the 2-core machine
    python -m app bench node_loss --quick      # fewer steps

Faults, each once the previous one was survived (a step logged after it): the node of a vLLM replica, the
node of a train worker. No node is added back (`Cluster.add_node` must run on the main thread, which runs
the driver here): the run finishes on the node left, which fits it. Writes benchmarks/results/node_loss[_quick].json:
completed, steps, each fault's node, what it held and the seconds to the next step, and the accounting (all 0
when nothing was lost or doubled).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_reliability import Injector, _rows
from common.data_accounting import data_accounting
from common.ray_utils import actors_by_node

REPO = Path(__file__).resolve().parents[1]

NODE_CPUS = 2


class NodeKiller(Injector):
    """bench reliability's injector, a whole worker node per fault instead of one process."""

    def __init__(self, cluster, run_dir: Path, faults: list[str], first_step: int, gap: int):
        super().__init__(None, run_dir, faults, first_step, gap)
        self.cluster = cluster

    def inject(self, fault: str) -> dict:
        want = {"replica": "RolloutReplica", "train_worker": "RayTrainWorker"}[fault]
        held = actors_by_node()
        node = next((n for n in self.cluster.worker_nodes if any(want in c for c in held.get(n.node_id, []))), None)
        if node is None:
            raise LookupError(f"no worker node holds a {want}; held: {held}")
        self.cluster.remove_node(node, allow_graceful=False)
        return {"node": node.node_id[:12], "held": sorted(held.get(node.node_id, []))}


def run(work: Path, model: Path, steps: int, prompts: int, gap: int) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    from app import driver
    from common import config as C

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(3):
        cluster.add_node(num_cpus=NODE_CPUS)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false",
                                       "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "600"}})
    cfg = C.load(str(REPO / "recipes" / "tiny-cpu.yaml"), [
        f"model.path={model}", "model.build_tiny=false", f"run.out_dir={work}", "run.name=node-loss",
        f"train.total_steps={steps}", "checkpoint.every=3", f"data.builtin_size={prompts}",
        "grpo.prompts_per_step=8", "grpo.group_size=4", "grpo.max_new_tokens=24", "eval.path=null",
        "run.stall_timeout_s=600", "rollout.proxy_location=HeadOnly"])  # the nodes share one machine's ports
    out: dict = {"config": {"steps": steps, "prompts": prompts, "nodes": f"head (0 CPU) + 3 x {NODE_CPUS} CPU",
                            "replicas": cfg.rollout.replicas, "train_workers": cfg.train.num_workers}}
    killer = NodeKiller(cluster, work / "node-loss", ["replica", "train_worker"], first_step=4, gap=gap)
    t0 = time.time()
    try:
        killer.start()
        try:
            summary = driver.run(cfg, progress=False)
            out.update(completed=True, steps=summary["steps"])
        except Exception as e:
            out.update(completed=False, error=f"{type(e).__name__}: {e}"[:800])
            summary = {}
        killer.stop.set()
        killer.join(timeout=5)
        out["wall_seconds"] = round(time.time() - t0, 1)
        out["faults"] = killer.log
        rows = _rows(work / "node-loss")
        out["data"] = data_accounting(rows, prompts, 8, 4, steps,
                                      ((summary.get("buffer") or {}).get("prompts") or {}).get("pending"))
    finally:
        ray.shutdown()
        cluster.shutdown()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args(argv)
    from app.tiny_model import ensure_model

    steps, prompts, gap = (12, 64, 3) if args.quick else (24, 128, 8)
    with tempfile.TemporaryDirectory(prefix="node-loss-") as tmp:
        work = Path(tmp)
        model = ensure_model(work / "tiny-model")
        res = run(work, Path(model), steps, prompts, gap)
    res.update(machine=f"{platform.machine()}, {os.cpu_count()} cores", command=" ".join(
        ["python -m app bench node_loss", *(["--quick"] if args.quick else [])]))
    print(json.dumps(res, indent=2, default=str))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "node_loss_quick.json" if args.quick else "node_loss.json"
    (out / name).write_text(json.dumps(res, indent=2, default=str) + "\n")
    return 0 if res.get("completed") else 1


if __name__ == "__main__":
    sys.exit(main())
