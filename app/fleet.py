"""Many runs, one fleet (docs/FLEET.md): `python -m app fleet up|status|down`, and a training run's lease on a
fleet (`python -m app train --fleet NAME`).

A fleet is a Serve application `fleet-NAME` (vLLM replicas + the ingress) and its FleetState actor, both
detached: they live on the Ray cluster (started with `ray start --head`, or any cluster a job joins) until
`fleet down`, whatever runs come and go. `fleet up` prints the fleet's admin token once (runs need it to
attach: LORA_GRPO_FLEET_TOKEN) and, with `--read-token`, the token REST readers need.
"""
from __future__ import annotations

import logging
import os
import threading
import time

from common.config import Config

logger = logging.getLogger("app")

FLEET_TOKEN_ENV = "LORA_GRPO_FLEET_TOKEN"
READ_TOKEN_ENV = "LORA_GRPO_FLEET_READ_TOKEN"
DEFAULT_SLOTS = 8
ATTACH_WAIT_POLL_S = 5.0


class FleetAttachError(RuntimeError):
    """The run could not attach to its fleet (not up, no token, full, rank too high): the message says why."""


class FleetLeaseLost(RuntimeError):
    """The fleet forgot a run still training (its lease ran out: the driver was stalled or cut off too long)."""


def _state(name: str):
    import ray

    from common.names import NAMESPACE, fleet_app

    try:
        return ray.get_actor(fleet_app(name), namespace=NAMESPACE)
    except ValueError:
        raise FleetAttachError(f"no fleet named {name!r} on this Ray cluster; start it with `python -m app fleet "
                               f"up --name {name} --model DIR`") from None


def _join_cluster(address: str | None) -> None:
    """Join a running cluster: a fleet outlives this process, so it must not live in a Ray started here."""
    from common.ray_connect import RayConnectError, connect_ray

    try:
        connect_ray(address, start_local=False, log_to_driver=False, logging_level=logging.ERROR)
    except RayConnectError as e:
        raise FleetAttachError(f"the fleet needs a running Ray cluster: {e}") from None


# ---------------------------------------------------------------------- up / status / down

def fleet_up(cfg: Config, name: str, slots: int, lease_s: float, admin_token: str | None = None,
             read_token: str | None = None, address: str | None = None) -> dict:
    """Start fleet `name` (cfg: the engines, replicas, router, HTTP port; `slots` adapter slots per replica)
    and return once every replica is healthy: {"app", "admin_token", "read_token", "http_port", ...}."""
    import ray
    from ray import serve

    from common.config import ConfigError, fleet_problems
    from common.names import NAMESPACE, REGISTRY_NAME, fleet_app
    from common.placement import on_driver_node
    from serve_deployments.app_builder import build_app, wait_healthy
    from serve_deployments.fleet_state import FleetState, digest, new_token

    if problems := fleet_problems(cfg):
        raise ConfigError(problems)
    _join_cluster(address)
    app = fleet_app(name)
    try:
        ray.get_actor(app, namespace=NAMESPACE)
        raise FleetAttachError(f"fleet {name} is already up (python -m app fleet status --name {name})")
    except ValueError:
        pass
    admin_token = admin_token or os.environ.get(FLEET_TOKEN_ENV) or new_token()
    read_token = read_token or os.environ.get(READ_TOKEN_ENV) or None
    info = {"model": str(cfg.model.path), "model_realpath": os.path.realpath(cfg.model.path),
            "dtype": cfg.model.dtype, "fp32_head": cfg.model.fp32_head, "replicas": cfg.rollout.replicas,
            "http_port": cfg.rollout.http_port, "max_num_seqs": cfg.rollout.max_num_seqs}
    # On the node `fleet up` runs on (the head, typically): the fleet's state outlives worker nodes.
    state = FleetState.options(name=app, namespace=NAMESPACE, lifetime="detached", **on_driver_node()).remote(
        name, app, slots, cfg.rollout.max_lora_rank, digest(admin_token), digest(read_token), lease_s, info)
    try:
        ray.get(state.ping.remote())
        serve.start(proxy_location=cfg.rollout.proxy_location,
                    http_options={"host": "0.0.0.0", "port": cfg.rollout.http_port})
        handle = serve.run(build_app(cfg, REGISTRY_NAME, NAMESPACE, fleet=name, admin_token=admin_token),
                           name=app, route_prefix="/")
        body = wait_healthy(handle)
    except BaseException:
        _down(name)
        raise
    return {"fleet": name, "app": app, "admin_token": admin_token, "read_token": read_token,
            "http_port": cfg.rollout.http_port, "replicas": body["replicas"], "slots": slots, "lease_s": lease_s}


def fleet_status(name: str, address: str | None = None) -> dict:
    """The fleet's runs (slots, weight, lease, tokens generated and share), its capacity and each replica's
    load and adapters."""
    import ray
    from ray import serve

    from common.names import fleet_app

    _join_cluster(address)
    out = ray.get(_state(name).describe.remote())
    ingress = serve.get_app_handle(fleet_app(name))
    fair = ingress.fleet_stats.remote().result(timeout_s=30)
    stats = ingress.stats.remote().result(timeout_s=30)
    for run, r in out["runs"].items():
        r.update(fair.get("runs", {}).get(run, {}))
    out["cards"] = ray.get(_state(name).cards.remote())
    out["base_tokens"] = fair.get("runs", {}).get("", {}).get("tokens", 0)
    out["inflight"], out["seq_capacity"] = fair.get("inflight"), fair.get("capacity")
    out["replica_stats"] = [{"replica_id": s.get("replica_id"), "ongoing": s.get("ongoing"),
                             "adapters": s.get("adapters", []), "quotas": s.get("quotas", {}),
                             "http_url": s.get("http_url")}
                            for s in stats.get("replicas", [])]
    return out


def format_status(st: dict) -> str:
    lines = [f"fleet {st['fleet']} (Serve app {st['app']}): {st.get('replicas')} replicas of {st.get('model')}, "
             f"http://127.0.0.1:{st.get('http_port')}/v1; adapter slots {st['used']}/{st['capacity']} per replica, "
             f"max_lora_rank {st['max_lora_rank']}, lease {st['lease_s']:.0f}s, sequences in flight "
             f"{st.get('inflight')}/{st.get('seq_capacity')}"]
    lines.append(f"{'run':<20} {'slots':>5} {'rank':>4} {'weight':>6} {'lease':>6} {'tokens':>9} {'share':>6} "
                 f"{'queued':>6}")
    for run, r in sorted(st["runs"].items()):
        lines.append(f"{run:<20} {r['slots']:>5} {r['lora_rank']:>4} {r['weight']:>6g} {r['lease_left_s']:>5.0f}s "
                     f"{r.get('tokens', 0):>9} {r.get('share', 0.0):>6.2f} {r.get('queued', 0):>6}")
    if not st["runs"]:
        lines.append("(no runs attached)")
    if st.get("cards"):
        from serve_deployments.run_card import run_card_app, run_card_route

        lines.append("in the dashboard's Serve view: " + ", ".join(
            f"{run_card_app(st['fleet'], run)} (GET {run_card_route(run)})" for run in st["cards"]))
    for rep in st.get("replica_stats", []):
        lines.append(f"replica {rep['replica_id']}: {rep['ongoing']} requests in flight, adapters "
                     f"{', '.join(rep['adapters']) or 'none'}"
                     + (f", REST on {rep['http_url']}" if rep.get("http_url") else ""))
    for left in st.get("left", []):
        when = time.strftime("%H:%M:%S", time.localtime(left["time"]))
        lines.append(f"left: {left['run']} ({left['status']}, {when})")
    return "\n".join(lines)


def fleet_down(name: str, admin_token: str | None, address: str | None = None) -> None:
    """Stop fleet `name` (its admin token): the Serve app and FleetState go; attached runs' rollouts fail."""
    import ray

    _join_cluster(address)
    token = admin_token or os.environ.get(FLEET_TOKEN_ENV)
    if not ray.get(_state(name).check_admin.remote(token)):
        raise FleetAttachError(f"fleet {name}: `fleet down` needs the fleet's admin token ({FLEET_TOKEN_ENV} or "
                               "--token)")
    _down(name)


def _down(name: str) -> None:
    import ray
    from ray import serve

    from common.names import NAMESPACE, fleet_app
    from serve_deployments.run_card import delete_all_run_cards

    try:
        delete_all_run_cards(name)
    except Exception as e:
        logger.warning("fleet %s: deleting the runs' cards failed: %s", name, e)
    try:
        serve.delete(fleet_app(name))
    except Exception as e:
        logger.warning("fleet %s: deleting the Serve app failed: %s", name, e)
    try:
        ray.kill(ray.get_actor(fleet_app(name), namespace=NAMESPACE))
    except ValueError:
        pass


# ---------------------------------------------------------------------- a run's lease

def engine_mismatch(cfg: Config, fleet: dict) -> str | None:
    """Why a run cannot train against this fleet's engines (`FleetState.describe()`), or None: its adapter
    must be a delta on the weights the fleet serves, and its behaviour logprobs must come from the dtype and
    head precision the trainer computes in."""
    name = fleet.get("fleet")
    mine, theirs = os.path.realpath(cfg.model.path), fleet.get("model_realpath")
    if theirs and mine != theirs:
        return (f"model.path {cfg.model.path} is not the model fleet {name} serves ({fleet.get('model')}): the "
                "run's adapter would be trained on other weights than it is sampled with")
    for key, value in (("dtype", cfg.model.dtype), ("fp32_head", cfg.model.fp32_head)):
        if key in fleet and fleet[key] != value:
            return (f"model.{key} {value} differs from fleet {name}'s engines ({fleet[key]}): the trainer's and the "
                    "engines' logprobs would not match")
    return None


class FleetLease:
    """A training run attached to a fleet: `attach` (at once, or waiting for slots with run.fleet_wait), a
    thread that renews the lease every lease_s / 4, and `detach` at the end. If the driver dies, renewals stop
    and the fleet forgets the run within the lease. `lost` says why the lease ended under the run's feet."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.run = cfg.run.name
        self.fleet = cfg.run.fleet
        self.token: str | None = None
        self.lease_s = 0.0
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def attach(self) -> str:
        import ray

        from serve_deployments.fleet_state import FleetError

        admin = self.cfg.run.fleet_token or os.environ.get(FLEET_TOKEN_ENV)
        if not admin:
            raise FleetAttachError(f"attaching to fleet {self.fleet} needs its admin token: set {FLEET_TOKEN_ENV} "
                                   "(printed by `fleet up`) or run.fleet_token")
        state = _state(self.fleet)
        mismatch = engine_mismatch(self.cfg, ray.get(state.describe.remote()))
        if mismatch:
            raise FleetAttachError(mismatch)
        meta = {"out_dir": str(self.cfg.run_dir), "pid": os.getpid()}
        while True:
            try:
                out = ray.get(state.attach.remote(admin, self.run, self.cfg.adapter_slots, self.cfg.run.fleet_weight,
                                                  self.cfg.lora.rank, meta))
                break
            except FleetError as e:
                full = e.status_code == 409 and " is full:" in str(e)
                if not (full and self.cfg.run.fleet_wait):
                    raise FleetAttachError(str(e)) from None
                logger.info("%s; waiting (run.fleet_wait)", e)
                time.sleep(ATTACH_WAIT_POLL_S)
        self.token, self.lease_s = out["token"], float(out["lease_s"])
        self._state = state
        self._thread = threading.Thread(target=self._renew, name=f"fleet-lease-{self.run}", daemon=True)
        self._thread.start()
        logger.info("fleet %s: attached as run %s (%d adapter slots, %d left free; lease %.0fs)", self.fleet, self.run,
                    out["slots"], out["free"], self.lease_s)
        return self.token

    def _renew(self) -> None:
        import ray

        from serve_deployments.fleet_state import FleetError

        while not self._stop.wait(max(0.5, self.lease_s / 4)):
            try:
                ray.get(self._state.renew.remote(self.run, self.token), timeout=max(1.0, self.lease_s / 4))
            except FleetError as e:
                self.lost = str(e)
                logger.error("fleet %s: %s", self.fleet, e)
                return
            except Exception as e:  # a slow or restarting FleetState: the next renewal may still make it
                logger.warning("fleet %s: lease renewal failed: %s", self.fleet, e)

    def detach(self, status: str) -> None:
        """End the lease: the fleet unloads the run's adapters and frees its slots now."""
        import ray

        self._stop.set()
        if self.token is None:
            return
        try:
            ray.get(self._state.detach.remote(self.run, self.token, status.lower()), timeout=120)
        except Exception as e:  # the lease runs out by itself
            logger.warning("fleet %s: detach failed (%s); the lease frees the run's slots within %.0fs",
                           self.fleet, e, self.lease_s)
