"""Test harness for the Serve side (replica and router tests share it).

- `serve_env` (module fixture): Ray with 4 logical CPUs, Serve on a free port, a real AdapterRegistry,
  all shut down at the module's end; the tiny model comes from conftest's session `tiny_model_dir`.
- re-exported from common/ (shared with the benchmarks): `make_lora_payload` (a PEFT LoRA over the tiny
  model with random non-zero B, as the (tensors, meta) pair the trainer publishes), `make_merged_payload`,
  `prompt_ids` (common.lora_payloads), `publish` (common.registry.publish_payload: the trainer's way, ref
  as a top-level argument), `retire_all`, `free_port` (common.ports).
- `peft_reference`: greedy tokens + per-token logprobs of the same adapter through PEFT (the truth the
  engine is compared with).
- `small_config`: a Config for 1-2 CPU replicas of the tiny model (GPU ones under LORA_GRPO_TEST_GPU=1).

Use from a test module: `from tests._serve_helpers import serve_env  # noqa: F401` (fixture).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from app.tiny_model import serve_config
from common.lora_payloads import (  # noqa: F401  (re-exported: the Serve tests import them from here)
    TARGETS,
    make_lora_payload,
    make_merged_payload,
    prompt_ids,
)
from common.lora_payloads import base_model as _base_model
from common.lora_payloads import peft_model as _peft_model
from common.ports import free_port
from common.registry import publish_payload as publish  # noqa: F401  (re-exported)
from common.registry import retire_all  # noqa: F401  (re-exported)

# CPU fp32, vLLM vs PEFT (or the trainer), the worst token of a sequence: the engine's batched kernels sum in an
# order that depends on the batch, so a 200-token request's worst token has reached 5.9e-5 (CI, 2026-12-05);
# a wrong version or adapter (make_lora_payload's B ~ N(0, 0.3)) is off by > 1e-2, so this still tells them apart.
LOGPROB_TOL = 2e-4


@dataclass
class ServeEnv:
    model_dir: Path
    registry: object  # ActorHandle of the AdapterRegistry
    tmp: Path
    http_port: int


@pytest.fixture(scope="module")
def serve_env(tiny_model_dir, tmp_path_factory):
    import ray
    from ray import serve

    from common.registry import get_or_create_registry

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    try:
        port = free_port()
        serve.start(http_options={"port": port})
        registry = get_or_create_registry(keep=100)  # tests decide what is live, not trimming
        yield ServeEnv(model_dir=tiny_model_dir, registry=registry, tmp=tmp_path_factory.mktemp("serve"),
                       http_port=port)
    finally:
        serve.shutdown()
        ray.shutdown()


def small_config(model_dir, replicas: int = 1, **kw):
    """app.tiny_model.serve_config; with LORA_GRPO_TEST_GPU=1 the same suites on a GPU machine."""
    cfg = serve_config(model_dir, replicas=replicas, **kw)
    if os.environ.get("LORA_GRPO_TEST_GPU") == "1":  # (vllm 0.25.1)
        # A GPU each when there are enough (two engines profiling one device at once failed to deploy
        # on vllm 0.25.1); otherwise shares of one.
        share = 1.0 if torch.cuda.device_count() >= replicas else round(0.9 / replicas, 3)
        cfg = cfg.replace(train={"use_gpu": True}, rollout={
            "gpus_per_replica": share, "gpu_memory_utilization": 0.4 if share == 1.0 else round(0.8 / replicas, 3)})
    return cfg


@torch.no_grad()
def peft_reference(model_dir, tensors, meta, prompt_ids: list[int], max_tokens: int):
    """Greedy continuation and per-token logprobs through PEFT (tensors=None: the base model)."""
    model = _base_model(model_dir) if tensors is None else _peft_model(model_dir, tensors, meta)
    ids = list(prompt_ids)
    out, lps = [], []
    for _ in range(max_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        logp = torch.log_softmax(logits, -1)
        tok = int(torch.argmax(logp))
        out.append(tok)
        lps.append(float(logp[tok]))
        ids.append(tok)
        if tok == model.config.eos_token_id:
            break
    return out, lps


@torch.no_grad()
def peft_logprobs_of(model_dir, tensors, meta, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
    """Teacher-forced logprob of each given token (tensors=None: the base model)."""
    model = _base_model(model_dir) if tensors is None else _peft_model(model_dir, tensors, meta)
    ids = torch.tensor([list(prompt_ids) + list(token_ids)])
    logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    n = len(prompt_ids)
    return [float(logp[n - 1 + i, t]) for i, t in enumerate(token_ids)]






def deploy_replicas(cfg, app_name: str = "replicas-test"):
    """Run RolloutReplica alone as a Serve app (no HTTP route) and return its DeploymentHandle."""
    from ray import serve

    from common.registry import NAMESPACE, REGISTRY_NAME
    from serve_deployments.engine_config import engine_kwargs, replica_options
    from serve_deployments.replica import RolloutReplica

    app = RolloutReplica.options(**replica_options(cfg)).bind(engine_kwargs(cfg), REGISTRY_NAME, NAMESPACE,
                                                              cfg.replica_slots)
    return serve.run(app, name=app_name, route_prefix=None)


class Versions:
    """Hands out fresh, increasing version numbers (the registry never accepts one twice)."""

    def __init__(self, start: int = 1):
        self.next = start

    def take(self, n: int = 1) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out




def replica_actor_names(app_name: str) -> list[str]:
    """Ray actor names of a Serve app's replicas (namespace "serve"), e.g. to ray.kill one."""
    import ray

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == "serve" and a["name"].startswith("SERVE_REPLICA::") and f"{app_name}#" in a["name"]]
