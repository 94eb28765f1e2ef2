"""The run's actors: the adapter registry, the run metrics, the rollout buffer (named, in the project
namespace), the rollout workers and the evaluator. They start with the run and end with it, success,
failure or Ctrl-C alike, so their names are free for the next run in the same cluster; the Serve app
ends with them unless the run keeps serving its policy (app/service.py)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from app.resume import Resume
from common.config import Config

if TYPE_CHECKING:
    from ray.actor import ActorHandle

logger = logging.getLogger("app")
RUNS_END_S = 10.0  # how long teardown waits for the rollout workers' calls to end
# rollout.partial: how long a batch waits for the version just published to be served (app/buffer.py); a load takes
# ~0.1-0.3 s on one GPU, so the bound is only reached when a publish hangs or fails (the trainer raises that itself)
TAKE_AFTER_SERVED_S = 5.0


@dataclass
class RunActors:
    registry: ActorHandle
    metrics: ActorHandle
    buffer: ActorHandle
    workers: list[ActorHandle] = field(default_factory=list)
    runs: list = field(default_factory=list)  # the workers' `run` calls (ObjectRefs)
    evaluator: ActorHandle | None = None
    lease: object | None = None  # app.fleet.FleetLease of a run attached to a fleet

    def teardown(self, cfg: Config, status: str, keep_serving: bool) -> None:
        """Close the trackers with the run's status ("FINISHED", "FAILED", "KILLED"), end every actor of
        the run, and delete its Serve app and registry unless it keeps serving."""
        import ray

        from app.service import delete_service, keep_service
        from common.ray_utils import kill_actor

        try:  # trackers flush and close their run (MLflow marks it FINISHED or FAILED); ray.kill would not
            ray.get(self.metrics.close.remote(status), timeout=60)
        except Exception as e:
            logger.warning("metrics close failed: %s", e)
        if status == "FINISHED" and self.runs:  # the buffer is closed: each worker ends after its last group
            ray.wait(self.runs, num_returns=len(self.runs), timeout=RUNS_END_S)
        for actor in [*self.workers, self.buffer, self.metrics, self.evaluator]:
            kill_actor(actor)
        # A run the kill ended is expected: taken here, so Ray does not report its error as unhandled.
        ended = ray.wait(self.runs, num_returns=len(self.runs), timeout=2.0)[0] if self.runs else []
        for ref in ended:
            try:
                ray.get(ref, timeout=0)
            except Exception:
                pass
        if cfg.run.fleet:  # the fleet serves on; the run's adapters leave with it
            if self.lease is not None:
                self.lease.detach(status)
            kill_actor(self.registry)
        elif keep_serving:
            keep_service(cfg.rollout.app_name, self.registry)
        else:
            delete_service(cfg.rollout.app_name, self.registry)


def start_run_actors(cfg: Config, rows: list[dict], resume: Resume | None) -> RunActors:
    """Registry, metrics and buffer; a resumed run's metrics keep the rows up to its checkpoint and its
    buffer skips exactly the prompts the checkpointed steps trained on (common/data_cursor.py)."""
    from app.buffer import RolloutBuffer
    from app.loggers import tracking_options
    from app.metrics import RunMetrics
    from common.names import BUFFER_NAME, METRICS_NAME
    from common.placement import on_driver_node
    from common.registry import get_or_create_registry
    from common.run_ingress import run_namespace_of

    here = on_driver_node()
    namespace = run_namespace_of(cfg)  # a fleet run's actors: a namespace of their own beside the other runs'
    registry = get_or_create_registry(keep=cfg.sync.live_versions, namespace=namespace, **here)
    metrics = RunMetrics.options(name=METRICS_NAME, namespace=namespace, **here).remote(
        str(cfg.run_dir), cfg.run.name, tracking=tracking_options(cfg),
        resume_step=resume.step if resume is not None else None)
    # The buffer is the run's one prompt source.
    buffer = RolloutBuffer.options(name=BUFFER_NAME, namespace=namespace, **here).remote(
        cfg.sync.max_staleness, cfg.grpo.prompts_per_step, rows, lead=0 if cfg.run.mode == "sync" else None,
        seed=cfg.data.shuffle_seed, epochs=cfg.data.epochs,
        consumed=resume.state.get("data") if resume is not None else None,
        trainer_version=resume.version if resume is not None else 0,
        take_after_served_s=TAKE_AFTER_SERVED_S if cfg.rollout.partial else 0.0)
    return RunActors(registry, metrics, buffer)
