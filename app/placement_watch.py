"""What Ray cannot place for a run, watched from the driver while no step arrives (app/watch.py): Ray Train's
worker group placement group still PENDING or RESCHEDULING, Serve replicas of the run's app waiting for a
node, rollout-worker actors waiting for one. Waiting longer than `run.placement_timeout_s` (a lost node and
nothing to take its place) stops the run with `UnplaceableError`: one line naming what waits for which
resources, what the cluster has, and the checkpoint `--resume` continues from once capacity is back.

Ray's own tables, read from the GCS so no dashboard is needed: `ray.util.placement_group_table()` and the
actor table (the one `ray._private.state.actors()` reads; its records carry each actor's required resources).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from app.stall_errors import UnplaceableError
from common.config import Config

logger = logging.getLogger("app")

LOOK_EVERY_S = 5.0
# An actor in these states with no worker address yet is waiting for a node (one being constructed has one).
WAITING_STATES = ("PENDING_CREATION", "RESTARTING")
UNPLACED_PG_STATES = ("PENDING", "RESCHEDULING")
TRAIN_CONTROLLER = "TrainController"


@dataclass
class Waiting:
    """Units of one kind the run needs (`total`), of which `placed` are placed; `need`: one unit's resources."""

    what: str
    need: dict[str, float]
    placed: int
    total: int
    verb: str = "placed"

    def describe(self) -> str:
        one = self.total == 1
        return (f"{self.what} need{'s' if one else ''} {fmt_resources(self.need)}{'' if one else ' each'}, "
                f"{self.placed} of {self.total} {self.verb}")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def fmt_resources(res: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(res.items())) + "}"


def _job_id() -> str:
    import ray

    return ray.get_runtime_context().get_job_id()


def train_waiting(job_id: str) -> list[Waiting]:
    """Placement groups of this job not (fully) placed: Ray Train's worker group is the only one a run makes.
    A placement group's id ends with its job's id (Ray's ID layout), and Ray Train's controller belongs to the
    driver's job."""
    import ray

    out = []
    for pg_id, pg in ray.util.placement_group_table().items():
        if not pg_id.endswith(job_id) or pg.get("state") not in UNPLACED_PG_STATES:
            continue
        bundles = list(pg.get("bundles", {}).values())
        placed = sum(1 for node in pg.get("bundles_to_node_id", {}).values() if node)
        out.append(Waiting(f"Ray Train's {_count(len(bundles), 'worker')}", bundles[0] if bundles else {}, placed,
                           len(bundles)))
    return out


def _actor_records(states: tuple[str, ...]) -> list[dict]:
    """The GCS actor table's records in `states`: class, job, whether it has a worker, required resources."""
    from ray._private import state
    from ray.core.generated import gcs_pb2

    accessor = state.state._connect_and_get_accessor()
    out = []
    for name in states:
        for raw in accessor.get_actor_table(None, name):
            a = gcs_pb2.ActorTableData.FromString(raw)
            out.append({"class": a.class_name, "job": a.job_id.hex(), "state": name,
                        "unplaced": name in WAITING_STATES and not a.address.port,
                        "need": {k: v for k, v in a.required_resources.items() if v}})
    return out


def actors_waiting(records: list[dict], app_name: str, job_id: str) -> list[Waiting]:
    """Serve replicas of the run's app (class ServeReplica:APP:DEPLOYMENT, Serve's controller owns them) and the
    run's rollout workers, per kind, when any of them waits for a node."""
    kinds: dict[tuple[str, str], list[dict]] = {}  # (owner, noun) -> records
    for r in records:
        if r["class"].startswith(f"ServeReplica:{app_name}:"):
            kinds.setdefault(("Serve's", f"{r['class'].rsplit(':', 1)[1]} replica"), []).append(r)
        elif r["class"] == "RolloutWorker" and r["job"] == job_id:
            kinds.setdefault(("the run's", "rollout worker"), []).append(r)
    out = []
    for (owner, noun), group in kinds.items():
        unplaced = [r for r in group if r["unplaced"]]
        if unplaced:
            alive = sum(1 for r in group if r["state"] == "ALIVE")
            out.append(Waiting(f"{owner} {_count(len(group), noun)}", unplaced[0]["need"], alive, len(group),
                               "running" if owner == "Serve's" else "placed"))
    return out


def cluster_line(needs: list[dict[str, float]]) -> str:
    """What the cluster has of the resources the waiting units need: free of total."""
    import ray

    keys = sorted({k for need in needs for k in need}) or ["CPU"]
    free, total = ray.available_resources(), ray.cluster_resources()
    return (f"the cluster has {fmt_resources({k: round(free.get(k, 0.0), 3) for k in keys})} free of "
            f"{fmt_resources({k: round(total.get(k, 0.0), 3) for k in keys})}")


def checkpoint_step(cfg: Config) -> int | None:
    from app.resume import find_checkpoint

    found = find_checkpoint(cfg.run_dir, cfg.train.num_workers)
    return int(found[1]["step"]) if found else None


class PlacementWatch:
    """Called by Progress while no step arrives; `reset` when one does. Looks every LOOK_EVERY_S seconds and
    raises UnplaceableError once something has waited for placement `run.placement_timeout_s` in a row."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.timeout = cfg.run.placement_timeout_s
        self.every = min(LOOK_EVERY_S, self.timeout / 4)
        self._since: float | None = None
        self._last_look = self._last_step = time.monotonic()

    def reset(self) -> None:
        """A step arrived: nothing waits, and the tables need no look until steps stop for `every` seconds."""
        self._since = None
        self._last_step = time.monotonic()

    def look(self) -> list[Waiting]:
        job = _job_id()
        return train_waiting(job) + actors_waiting(_actor_records(("ALIVE", *WAITING_STATES)),
                                                   self.cfg.rollout.app_name, job)

    def check(self, last_step: int) -> None:
        now = time.monotonic()
        if now - self._last_step < self.every or now - self._last_look < self.every:
            return
        self._last_look = now
        try:
            waiting = self.look()
        except Exception as e:  # the tables are advisory: the stall timeout still ends a stuck run
            logger.debug("placement look failed: %s", e)
            return
        if not waiting:
            self._since = None
            return
        if self._since is None:
            self._since = now
            logger.warning("waiting for placement: %s; %s (stops after run.placement_timeout_s=%.0fs)",
                           "; ".join(w.describe() for w in waiting), cluster_line([w.need for w in waiting]),
                           self.timeout)
        if now - self._since >= self.timeout:
            raise UnplaceableError(self.message(waiting, last_step, now - self._since))

    def message(self, waiting: list[Waiting], last_step: int, waited: float) -> str:
        ckpt = checkpoint_step(self.cfg)
        where = (f"stopped at step {last_step} (checkpoint step {ckpt}); add nodes, then python -m app train "
                 f"--resume {self.cfg.run_dir}" if ckpt is not None else
                 f"stopped at step {last_step} with no checkpoint (checkpoint.every={self.cfg.checkpoint.every}); "
                 "add nodes, then start the run again")
        return (f"cannot place the run: {'; '.join(w.describe() for w in waiting)}; "
                f"{cluster_line([w.need for w in waiting])}; waited {waited:.0f}s (run.placement_timeout_s); {where}")


def wait_service_running(cfg: Config, app_name: str, last_step: int = 0, poll_s: float = 0.5) -> None:
    """Until Serve reports `app_name` RUNNING. RuntimeError when its deployment failed (a replica's constructor
    raised); UnplaceableError once some of its replicas waited run.placement_timeout_s in a row for a node. A
    placed replica may take as long as its engine needs to start: Serve's own health checks bound that."""
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    watch = PlacementWatch(cfg)
    while True:
        st = serve.status().applications.get(app_name)
        status = getattr(st, "status", None)
        if status == ApplicationStatus.RUNNING:
            return
        if status == ApplicationStatus.DEPLOY_FAILED:
            raise RuntimeError(f"Deploying application {app_name} failed: {st.message}")
        watch.check(last_step)
        time.sleep(poll_s)


def abort_train_controller() -> None:
    """End this job's Ray Train controller, so `trainer.fit()` returns now instead of waiting out Ray Train's
    worker-group start timeout for a placement that cannot come. Its placement group goes with it (Ray
    Train's cleaner). The controller is unnamed: its handle comes from its id in the actor table."""
    import ray
    from ray._private import state

    job = _job_id()
    for actor_id, a in state.actors().items():
        if a.get("ActorClassName") == TRAIN_CONTROLLER and a.get("JobID") == job and a.get("State") != "DEAD":
            try:
                handle = ray._private.worker.global_worker.core_worker.get_actor_handle(
                    ray.ActorID.from_hex(actor_id))
                ray.kill(handle, no_restart=True)
            except Exception as e:
                logger.warning("could not end Ray Train's controller %s: %s", actor_id, e)
