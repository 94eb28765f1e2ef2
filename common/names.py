"""Names both sides of the run look each other up by: the named Ray actors, their namespace, and the
base model's public id. One place, so `train_loops/` and `serve_deployments/` never copy them or
reach into `app/` for them."""

NAMESPACE = "lora_grpo"
REGISTRY_NAME = "adapter-registry"  # AdapterRegistry: published adapter payloads, live versions
BUFFER_NAME = "rollout-buffer"  # RolloutBuffer: groups between rollout workers and the trainer
METRICS_NAME = "run-metrics"  # RunMetrics: per-step rows, trackers, gauges
BASE_NAME = "base"  # the public model id of the base model (no adapter) on the REST endpoint
FLEET_PREFIX = "fleet-"  # a fleet NAME is the Serve app `fleet-NAME` and its FleetState actor `fleet-NAME`


def run_namespace(run: str = "") -> str:
    """The Ray namespace of a run's own actors (registry, buffer, metrics): the project namespace for a
    standalone run, `lora_grpo.run.RUN` for a run attached to a fleet, so runs sharing a cluster never
    collide on names."""
    return f"{NAMESPACE}.run.{run}" if run else NAMESPACE


def fleet_app(fleet: str) -> str:
    """The Serve application (and the FleetState actor) name of a fleet."""
    return f"{FLEET_PREFIX}{fleet}"
