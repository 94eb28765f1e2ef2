"""Names both sides of the run look each other up by: the named Ray actors, their namespace, and the
base model's public id. One place, so `train_loops/` and `serve_deployments/` never copy them or
reach into `app/` for them."""

NAMESPACE = "lora_grpo"
REGISTRY_NAME = "adapter-registry"  # AdapterRegistry: published adapter payloads, live versions
BUFFER_NAME = "rollout-buffer"  # RolloutBuffer: groups between rollout workers and the trainer
METRICS_NAME = "run-metrics"  # RunMetrics: per-step rows, trackers, gauges
BASE_NAME = "base"  # the public model id of the base model (no adapter) on the REST endpoint
