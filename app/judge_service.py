"""The judge model's own Serve app (reward.judge.model set): the same app as the policy's (the ingress in front
of vLLM replicas, serve_deployments/app_builder.py) over the judge model, with reward.judge.replicas replicas of
reward.judge.cpus / gpus each, and an adapter registry of its own that stays empty (the judge samples its
base weights, version 0). The driver starts it beside the policy app and deletes it with the run."""
from __future__ import annotations

import logging

from common.config import Config

logger = logging.getLogger("app")

# The judge apps' registries, by app name: a named actor dies with its last handle, and the judge app's replicas
# and ingress look theirs up by name (ingress: at its first call), so the driver holds it until the run ends.
_REGISTRIES: dict = {}


def judge_app_name(cfg: Config) -> str:
    """Unique per run: a fleet's runs each start their own judge app on the fleet's cluster."""
    return f"{cfg.rollout.app_name}-judge" + (f"-{cfg.run.name}" if cfg.run.fleet else "")


def judge_namespace(cfg: Config) -> str:
    from common.run_ingress import run_namespace_of

    return f"{run_namespace_of(cfg)}.judge"


def judge_service_config(cfg: Config) -> Config:
    """The run's config with the judge model in the policy's place: what the judge app is built from."""
    judge = cfg.reward.judge
    return cfg.replace(model={"path": judge.model, "build_tiny": False},
                       rollout={"app_name": judge_app_name(cfg), "replicas": judge.replicas,
                                "cpus_per_replica": judge.cpus, "gpus_per_replica": judge.gpus,
                                "replica_http_port": None, "front_port": None},
                       sync={"mode": "adapter"})


def start_judge_service(cfg: Config, last_step: int = 0):
    """Start the judge app and wait until it serves; returns its ingress handle (None: no judge model)."""
    import ray
    from ray import serve

    from app.placement_watch import wait_service_running
    from common.names import REGISTRY_NAME
    from common.placement import on_driver_node
    from common.registry import get_or_create_registry
    from serve_deployments.app_builder import build_app, wait_healthy

    if cfg.reward.judge.template is None or cfg.reward.judge.model is None:
        return None
    judge_cfg = judge_service_config(cfg)
    namespace = judge_namespace(cfg)
    registry = get_or_create_registry(namespace=namespace, **on_driver_node())
    # Nothing is ever published to it: the replicas serve version 0, and no policy adapter reaches them. The call
    # waits until the actor exists: a replica looks it up by name when it starts.
    ray.get(registry.attach_ingress.remote(None))
    name = judge_app_name(cfg)
    _REGISTRIES[name] = registry
    app = build_app(judge_cfg, REGISTRY_NAME, namespace)
    handle = serve.run_many([serve.RunTarget(app, name=name, route_prefix=f"/{name}")],
                            wait_for_applications_running=False)[0]
    wait_service_running(judge_cfg, name, last_step=last_step)
    wait_healthy(handle)
    logger.info("judge: app %r, %d replicas of %s", name, judge_cfg.rollout.replicas, judge_cfg.model.path)
    return handle


def judge_app_handle(cfg: Config):
    """A getter of the judge app's ingress handle, taken when first called (in a rollout worker)."""
    cache: list = []

    def handle():
        if not cache:
            from ray import serve

            cache.append(serve.get_app_handle(judge_app_name(cfg)))
        return cache[0]

    return handle


def stop_judge_service(cfg: Config) -> None:
    """Delete the judge app and its registry; a judge that never started is nothing to stop."""
    from ray import serve

    from common.ray_utils import kill_actor

    if cfg.reward.judge.template is None or cfg.reward.judge.model is None:
        return
    try:
        serve.delete(judge_app_name(cfg))
    except Exception as e:  # teardown goes on to the registry
        logger.warning("could not delete the judge app: %s", e)
    kill_actor(_REGISTRIES.pop(judge_app_name(cfg), None))
