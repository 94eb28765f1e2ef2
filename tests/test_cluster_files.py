"""The cluster files parse, and the job they run points at a recipe that validates."""
from pathlib import Path

import yaml

from common import config as C

REPO = Path(__file__).resolve().parent.parent


def test_rayjob_runs_a_valid_recipe():
    job = yaml.safe_load((REPO / "cluster" / "kuberay-rayjob.yaml").read_text())
    assert job["kind"] == "RayJob"
    words = job["spec"]["entrypoint"].split()
    recipe = words[words.index("--config") + 1]
    cfg = C.load(str(REPO / recipe))
    gpus = sum(g["replicas"] * int(g["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu", 0))
               for g in job["spec"]["rayClusterSpec"]["workerGroupSpecs"])
    # the cluster must hold the trainer's GPUs plus one per rollout replica
    assert gpus >= cfg.train.num_workers + cfg.rollout.replicas * cfg.rollout.gpus_per_replica


def test_runtime_env_parses():
    env = yaml.safe_load((REPO / "cluster" / "runtime_env.yaml").read_text())
    assert env["env_vars"]["HF_HUB_OFFLINE"] == "1"
