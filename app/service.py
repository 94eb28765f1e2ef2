"""The rollout service from the app's side: start it for a run (Serve's own logs in RUN_DIR/logs/serve),
keep it serving the final policy after the run or delete it, and `python -m app serve` (serve a model and
optionally a saved adapter until interrupted). The Serve application itself is assembled and started in
serve_deployments/app_builder.py."""
from __future__ import annotations

import logging
import signal
import time

from common.config import Config

logger = logging.getLogger("app")

# Apps a finished run left serving, with their registry: a named actor dies with its last handle.
_SERVING: dict = {}
# The REST front of each app (rollout.front_port): an HAProxy child of this process, ended with its app.
_FRONTS: dict = {}


def start_rollout_service(cfg: Config, registry, verbose: bool = False, last_step: int = 0):
    """The run's Serve app (the ingress in front of rollout.replicas vLLM replicas), once every replica is
    healthy; returns the ingress handle. Serve's controller and proxy log to RUN_DIR/logs/serve, WARNING
    and up unless verbose; a Serve instance already running keeps its own settings. A replica that no node
    can hold ends the start after run.placement_timeout_s with UnplaceableError (`last_step`: where a
    resumed run stands, for its line)."""
    from functools import partial

    from ray.serve.schema import LoggingConfig

    from app.placement_watch import wait_service_running
    from serve_deployments.app_builder import start_service, wait_healthy

    logging_config = LoggingConfig(log_level="INFO" if verbose else "WARNING",
                                   logs_dir=str(cfg.run_dir / "logs" / "serve"), enable_access_log=verbose)
    ingress = start_service(cfg, registry=registry, logging_config=logging_config,
                            wait_running=partial(wait_service_running, cfg, last_step=last_step))
    wait_healthy(ingress)
    start_front(cfg, ingress)
    return ingress


def start_front(cfg: Config, ingress):
    """The app's REST front (rollout.front_port, on by default; serve_deployments/haproxy_front.py); its URL is
    logged, or why it is off. A front already up for the app (a resumed run) is replaced."""
    from serve_deployments.haproxy_front import start_front as _start

    stop_front(cfg.rollout.app_name)
    watch = _start(cfg, ingress)
    if watch is not None:
        _FRONTS[cfg.rollout.app_name] = watch
        logger.info("REST front on %s (generation straight to the replicas' ports)", watch.front.url)
    return watch


def front_url(app_name: str) -> str | None:
    """The URL of the app's REST front, None when it has none."""
    watch = _FRONTS.get(app_name)
    return watch.front.url if watch is not None else None


def stop_front(app_name: str) -> None:
    watch = _FRONTS.pop(app_name, None)
    if watch is not None:
        watch.stop()


def keep_service(app_name: str, registry) -> None:
    """The run is over but its app keeps serving the final policy; `stop_serving` ends it."""
    _SERVING[app_name] = registry


def delete_service(app_name: str, registry) -> None:
    """The app and its registry end with the run; a Serve already gone does not keep the registry alive."""
    from ray import serve

    from common.ray_utils import kill_actor

    stop_front(app_name)
    try:
        serve.delete(app_name)
    except Exception as e:  # teardown must reach the registry even if Serve is gone
        logger.warning("could not delete Serve app %s: %s", app_name, e)
    kill_actor(registry)


def stop_serving(app_name: str) -> None:
    """End what `run(..., keep_serving=True)` left up: the Serve app and its registry."""
    import ray
    from ray import serve

    stop_front(app_name)
    serve.delete(app_name)
    registry = _SERVING.pop(app_name, None)
    if registry is not None:
        ray.kill(registry)


def serve_policy(cfg: Config, payload: tuple[dict, dict] | None, adapter_dir: str | None,
                 address: str | None) -> None:
    """`python -m app serve`: join or start Ray, publish the adapter (if any) as policy-v1, serve until
    Ctrl-C or SIGTERM, then delete the app and shut Ray down."""
    import ray
    from ray import serve

    from common.placement import on_driver_node
    from common.ray_connect import connect_ray
    from common.registry import get_or_create_registry
    from serve_deployments.app_builder import start_with_adapter, wait_healthy

    connect_ray(address or cfg.run.ray_address)
    registry = get_or_create_registry(**on_driver_node())
    handle, version = start_with_adapter(cfg, registry, payload)
    if version is not None:
        print(f"published {adapter_dir} as policy-v{version} (policy-latest)", flush=True)
    body = wait_healthy(handle)
    front = start_front(cfg, handle)  # on by default; None after its one line when it cannot start
    serve_url = f"http://127.0.0.1:{cfg.rollout.http_port}/v1"
    print(f"serving {cfg.model.path} on {front.front.url if front else serve_url} "
          f"({body['replicas']} replicas, live: {body['live'] or 'base only'}); Ctrl-C to stop", flush=True)
    if front is not None:
        print(f"  that is the REST front (generation straight to the replicas' ports, routed); every route also on "
              f"Serve's port {serve_url} (two Python hops slower)", flush=True)
    direct = [s["http_url"] for s in handle.stats.remote().result()["replicas"] if s.get("http_url")]
    if direct:  # rollout.replica_http_port
        print(f"each replica also on its own port (no routing): {', '.join(direct)}", flush=True)
    # SIGTERM (docker stop, Kubernetes, a background job) stops it like Ctrl-C: app deleted, Ray shut down.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("stopping", flush=True)
    finally:
        stop_front(cfg.rollout.app_name)
        serve.delete(cfg.rollout.app_name)
        ray.shutdown()
