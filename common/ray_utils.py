"""Ray helpers every side uses: find a named actor of the run, end an actor, start or join Ray.

The driver, the train workers, the rollout workers and the tools all reach the run's named actors
(registry, buffer, metrics) through `named_actor`, and end what they started with `kill_actor`; the
driver and the one-shot commands start or join Ray with `init_ray`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from common.names import NAMESPACE

if TYPE_CHECKING:
    from common.config import Config


def named_actor(name: str | None, namespace: str = NAMESPACE):
    """The named actor of the run whose namespace is `namespace` (registry, buffer, metrics; a fleet run's live
    in a namespace of their own: common.run_ingress.run_namespace_of), when a name is given and this process is
    in Ray. The namespace is an argument, never process state: one process may work for several runs."""
    if not name:
        return None
    import ray

    if not ray.is_initialized():
        return None
    return ray.get_actor(name, namespace=namespace)


def kill_actor(actor) -> None:
    """End an actor this process started; one already gone is not an error."""
    import ray

    if actor is None:
        return
    try:
        ray.kill(actor)
    except Exception:  # already dead
        pass


def init_ray(cfg: Config, verbose: bool = False) -> None:
    """Start or join Ray (run.ray_address, else RAY_ADDRESS, else a local cluster; common.ray_connect: token
    authentication, and an error saying why a cluster cannot be joined), quiet by default
    through Ray's own switches: workers' stdout/stderr stay in Ray's session log files
    (log_to_driver=False), worker-side Ray logging at WARNING (LoggingConfig), the driver's Ray logger at
    WARNING; vLLM, DeepSpeed and transformers levels travel in the job's env. --verbose streams everything.
    A process already in Ray keeps its connection."""
    import logging
    import os

    import ray

    from common.ray_connect import connect_ray

    if ray.is_initialized():
        return
    level = "INFO" if verbose else "WARNING"
    env = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           # Ray Train gives a worker group 60 s to start; a loaded 2-core machine can need more.
           "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": os.environ.get("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "600"),
           "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", level),
           "DS_LOG_LEVEL": os.environ.get("DS_LOG_LEVEL", level.lower()),
           "TRANSFORMERS_VERBOSITY": os.environ.get("TRANSFORMERS_VERBOSITY", "info" if verbose else "error"),
           "PYTHONWARNINGS": os.environ.get("PYTHONWARNINGS", "default" if verbose else "ignore")}
    os.environ.setdefault("VLLM_LOGGING_LEVEL", env["VLLM_LOGGING_LEVEL"])  # read by engine_env for replicas
    connect_ray(cfg.run.ray_address, log_to_driver=verbose, logging_level=logging.INFO if verbose else logging.ERROR,
                logging_config=ray.LoggingConfig(encoding="TEXT", log_level=level), runtime_env={"env_vars": env})


def actors_by_node() -> dict[str, list[str]]:
    """Live actors' class names per node id (the GCS's table: no dashboard needed)."""
    from ray._private import state

    out: dict[str, list[str]] = {}
    for a in state.actors().values():
        if a.get("State") == "ALIVE":
            out.setdefault((a.get("Address") or {}).get("NodeID", ""), []).append(a.get("ActorClassName") or "")
    return out
