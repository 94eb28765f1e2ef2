"""Assemble and start the Serve application: the Ingress in front of R vLLM replicas. `start_service` is
the one place Serve itself is started (`serve.start`), for a training run, `python -m app serve` and
`python -m app eval` alike."""
from __future__ import annotations

import logging
import os
import time

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.schema import LoggingConfig

from common.config import Config
from serve_deployments.ingress import ADMIN_TOKEN_ENV, Ingress

logger = logging.getLogger(__name__)


def routing_options(cfg: Config) -> dict | None:
    """The ingress's `RoutingPolicy(**routing_options(cfg))`; None = router.policy serve_default."""
    r = cfg.router
    if r.policy == "serve_default":
        return None
    return {"policy": r.policy, "imbalance": r.imbalance, "max_tracked_blocks": r.max_tracked_blocks,
            "skip_generic": r.skip_generic}


def router_config(cfg: Config) -> RequestRouterConfig | None:
    """The replica deployment's request router: PolicyRouter, which asks the ingress's policy through each
    call's RouteTicket; None = Serve's built-in one (router.policy serve_default)."""
    if cfg.router.policy == "serve_default":
        return None
    return RequestRouterConfig(request_router_class="serve_deployments.request_router:PolicyRouter")


def build_app(cfg: Config, registry_name: str, registry_namespace: str, fleet: str | None = None,
              admin_token: str | None = None) -> serve.Application:
    """The app: the ingress in front of rollout.replicas vLLM replicas. A fleet's (`fleet` NAME) serves every
    attached run's adapters in `cfg.replica_slots` slots per replica, and its admin token is the fleet's."""
    from serve_deployments.engine_config import SHUTDOWN_POLL_S, engine_kwargs, replica_options, tool_parser_option
    from serve_deployments.replica import RolloutReplica

    opts = replica_options(cfg)
    rrc = router_config(cfg)
    if rrc is not None:
        opts["request_router_config"] = rrc
    replica = RolloutReplica.options(**opts).bind(engine_kwargs(cfg), registry_name, registry_namespace,
                                                  cfg.replica_slots, tool_parser=tool_parser_option(cfg),
                                                  stream_interval_ms=cfg.rollout.stream_interval_ms,
                                                  http=replica_http_options(cfg),
                                                  **({"fleet": fleet} if fleet else {}))
    token = admin_token or cfg.rollout.admin_token or os.environ.get(ADMIN_TOKEN_ENV) or None
    ingress = Ingress.options(graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S, ray_actor_options={
        "num_cpus": 0.1, "runtime_env": {"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}}})
    fleet_kwargs = {"fleet": fleet, "fleet_seqs": cfg.rollout.replicas * cfg.rollout.max_num_seqs} if fleet else {}
    return ingress.bind(replica, str(cfg.model.path), cfg.rollout.replicas, registry_name, registry_namespace, token,
                        routing_options(cfg), max_inflight_per_replica(cfg), cfg.rollout.max_body_bytes,
                        **fleet_kwargs)


def replica_http_options(cfg: Config) -> dict | None:
    """The replica's own REST port (replica_http.py), None when rollout.replica_http_port is off."""
    if cfg.rollout.replica_http_port is None:
        return None
    return {"host": "0.0.0.0", "port": cfg.rollout.replica_http_port,
            "max_inflight": max_inflight_per_replica(cfg), "max_body_bytes": cfg.rollout.max_body_bytes}


def max_inflight_per_replica(cfg: Config) -> int:
    """rollout.max_inflight_per_replica, or 4 x max_num_seqs: enough queued work to keep an engine's
    batch full, not so much that a burst waits unboundedly (the ingress answers 429 beyond it)."""
    return cfg.rollout.max_inflight_per_replica or 4 * cfg.rollout.max_num_seqs


def start_service(cfg: Config, registry_name: str | None = None, registry_namespace: str | None = None,
                  registry=None, logging_config: LoggingConfig | None = None,
                  wait_running=None) -> serve.handle.DeploymentHandle:
    """Start Serve (HTTP on rollout.http_port; `logging_config` for its controller and proxy), run the app
    (name rollout.app_name, route prefix "/") and attach the registry to it, so publishes load on every
    replica. Returns the ingress handle. `serve.run` waits for the app without a bound (a replica no node
    can hold waits forever); with `wait_running(app_name)` the app is deployed without waiting and that
    callable does the waiting (and may give up: app/placement_watch.wait_service_running)."""
    import ray

    from common.placement import on_driver_node
    from common.registry import NAMESPACE, REGISTRY_NAME, get_or_create_registry

    registry_name = registry_name or REGISTRY_NAME
    registry_namespace = registry_namespace or NAMESPACE
    if registry is None:
        own = (registry_name, registry_namespace) == (REGISTRY_NAME, NAMESPACE)
        registry = (get_or_create_registry(**on_driver_node()) if own
                    else ray.get_actor(registry_name, namespace=registry_namespace))
    # No-op (with a warning) when Serve already runs, e.g. on another port in tests: it keeps its settings.
    serve.start(proxy_location=cfg.rollout.proxy_location, logging_config=logging_config,
                http_options={"host": "0.0.0.0", "port": cfg.rollout.http_port})
    app = build_app(cfg, registry_name, registry_namespace)
    if wait_running is None:
        handle = serve.run(app, name=cfg.rollout.app_name, route_prefix="/")
    else:
        handle = serve.run_many([serve.RunTarget(app, name=cfg.rollout.app_name, route_prefix="/")],
                                wait_for_applications_running=False)[0]
        wait_running(cfg.rollout.app_name)
    ray.get(registry.attach_ingress.remote(cfg.rollout.app_name))
    return handle


def start_with_adapter(cfg: Config, registry, payload: tuple[dict, dict] | None = None
                       ) -> tuple[serve.handle.DeploymentHandle, int | None]:
    """What `app serve` does: publish the adapter (if any) BEFORE the app starts, so every replica
    loads it in its constructor (before Serve routes to it) and /health cannot answer 200 while
    policy-v1 is unknown. Returns the ingress handle and the adapter's version."""
    import ray

    from common.adapter_io import pack_tensors

    version = None
    if payload is not None:
        ray.get(registry.attach_ingress.remote(None))  # no app yet: the registry just holds it, live
        version = ray.get(registry.latest_version.remote()) + 1
        ray.get(registry.publish.remote(version, ray.put(pack_tensors(payload[0])), payload[1]))
    return start_service(cfg, registry=registry), version


def wait_healthy(handle, timeout_s: float = 300.0, *, interval_s: float = 0.5, progress_s: float = 30.0,
                 log=None) -> dict:
    """Block until every replica is ready and holds every live version. While not ready, a line about
    every `progress_s` seconds names the elapsed time and the health body's reason (to `log`; print,
    flushed, by default); the TimeoutError names the last reason too."""
    def why(body) -> str:
        if not isinstance(body, dict):
            return repr(body)
        extra = []
        if "replicas_ready" in body:
            extra.append(f"replicas_ready {body['replicas_ready']}" + (f"/{body['replicas']}" if "replicas" in body
                                                                        else ""))
        if body.get("missing_versions"):
            extra.append(f"missing_versions {body['missing_versions']}")
        return str(body.get("reason", body)) + (f" ({', '.join(extra)})" if extra else "")

    emit = log or (lambda msg: print(msg, flush=True))
    start = time.monotonic()
    deadline, next_log = start + timeout_s, start + progress_s
    while True:
        ready, body = handle.health.remote().result()
        if ready:
            return body
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(f"service not healthy after {timeout_s:.0f}s: {why(body)}; {body}")
        if now >= next_log:
            emit(f"service not ready after {now - start:.0f} s: {why(body)}")
            next_log = now + progress_s
        time.sleep(interval_s)


def _adapter_rank_sets(rank: int, sets: list[str]) -> list[str]:
    """The served adapter decides `lora.rank`; `rollout.max_lora_rank` follows it (the smallest rank
    vLLM's LoRA kernels accept, unless the user set one) so a rank-1 adapter is not refused."""
    from common.config import VLLM_LORA_RANKS

    out = [s for s in sets if not s.startswith("lora.rank=")] + [f"lora.rank={rank}"]
    if not any(s.startswith("rollout.max_lora_rank=") for s in sets):
        out.append(f"rollout.max_lora_rank={min(r for r in VLLM_LORA_RANKS if r >= rank)}")
    return out


def read_adapter_payload(adapter_dir: str, sets: list[str]) -> tuple[tuple[dict, dict], list[str]]:
    """A saved PEFT adapter as the (tensors, meta) pair the registry publishes, and the config overrides
    its rank implies. Raises AdapterError for a bad directory, before anything starts."""
    from common.adapter_io import make_meta, read_peft_dir

    tensors, peft_cfg = read_peft_dir(adapter_dir)
    payload = (tensors, make_meta(tensors, peft_cfg, kind="adapter", source=str(adapter_dir)))
    return payload, _adapter_rank_sets(int(peft_cfg.get("r", 8)), sets)
