"""What a run asks Ray for, derived from the config in one place: the train workers' and the rollout
replicas' resources, and whether they fit the cluster before anything starts.

One GPU: `train.gpus_per_worker: 0.5` and `rollout.gpus_per_replica: 0.5` put the trainer and one vLLM
replica on the same GPU (Ray packs fractional GPUs onto one device; vLLM's `gpu_memory_utilization`
caps the engine's share and the trainer sizes its micro-batches from what is left). Two or more GPUs:
whole GPUs for each side, the counts chosen by `train.num_workers` and `rollout.replicas`.
"""
from __future__ import annotations

from common.config import Config


def on_driver_node() -> dict:
    """Actor options that place an actor on the node of the process calling this (the run's driver; under
    `ray job submit` the head node). The run's own state (registry, buffer, metrics, evaluator) lives
    there: it holds no CPU or GPU, and losing a worker node then never takes it, only replicas and
    workers, which come back (docs/ARCHITECTURE.md, "Faults"). Not soft: on another node a lost node
    would take the run's state with it, which is worse than waiting."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                                  soft=False)}


def trainer_resources(cfg: Config) -> dict[str, float]:
    """Ray resources of one train worker."""
    t = cfg.train
    return {"CPU": t.cpus_per_worker, **({"GPU": t.gpus_per_worker} if t.use_gpu else {})}


def replica_resources(cfg: Config) -> dict[str, float]:
    """Ray resources of one rollout replica (tensor-parallel engines take whole GPUs)."""
    r = cfg.rollout
    return {"CPU": r.cpus_per_replica, **({"GPU": r.gpus_per_replica} if r.gpus_per_replica > 0 else {})}


def gpu_requests(cfg: Config) -> list[float]:
    """Every GPU request of the run, one entry per actor."""
    t, r = cfg.train, cfg.rollout
    return ([t.gpus_per_worker] * t.num_workers if t.use_gpu else []) + \
        ([r.gpus_per_replica] * _replicas(cfg) if r.gpus_per_replica > 0 else [])


def _replicas(cfg: Config) -> int:
    """The run's own vLLM replicas: none on a fleet (the fleet's are placed already)."""
    return 0 if cfg.run.fleet else cfg.rollout.replicas


def total_request(cfg: Config) -> dict[str, float]:
    t, r = cfg.train, cfg.rollout
    return {"CPU": t.num_workers * t.cpus_per_worker + _replicas(cfg) * r.cpus_per_replica,
            "GPU": sum(gpu_requests(cfg))}


def gpus_needed(cfg: Config) -> int:
    """Whole GPUs the requests pack into: Ray places a fractional request on one device, so fractions
    pack first-fit (largest first) and whole ones take a device each."""
    free: list[float] = []
    for req in sorted(gpu_requests(cfg), reverse=True):
        if req >= 1:
            free += [0.0] * int(req)
            continue
        for i, f in enumerate(free):
            if f >= req - 1e-9:
                free[i] = f - req
                break
        else:
            free.append(1.0 - req)
    return len(free)


def fit_problems(cfg: Config, cluster: dict[str, float]) -> list[str]:
    """Why the run cannot be placed on a cluster with these total resources (`ray.cluster_resources()`)."""
    problems = []
    need_gpus, have_gpus = gpus_needed(cfg), int(cluster.get("GPU", 0))
    if need_gpus > have_gpus:
        t, r = cfg.train, cfg.rollout
        problems.append(
            f"the run needs {need_gpus} GPU(s) (train: {t.num_workers} x {t.gpus_per_worker if t.use_gpu else 0}, "
            f"rollout: {r.replicas} x {r.gpus_per_replica}) but the Ray cluster has {have_gpus}; lower "
            "train.num_workers / rollout.replicas, or share one GPU with train.gpus_per_worker=0.5 and "
            "rollout.gpus_per_replica=0.5 (recipes/gpu-1x.yaml)")
    cpus = total_request(cfg)["CPU"]
    if cpus > cluster.get("CPU", 0) + 1e-9:
        problems.append(f"the run reserves {cpus:g} CPUs (train.cpus_per_worker, rollout.cpus_per_replica) but the "
                        f"Ray cluster has {cluster.get('CPU', 0):g}")
    return problems
