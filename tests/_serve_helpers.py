"""Test harness for the Serve side (replica and router tests share it).

- `serve_env` (module fixture): Ray with 4 logical CPUs, Serve on a free port, a real AdapterRegistry,
  all shut down at the module's end; the tiny model comes from conftest's session `tiny_model_dir`.
- `make_lora_payload`: a PEFT LoRA over the tiny model with random non-zero B (so it visibly changes
  outputs), as the (tensors, meta) pair the trainer publishes.
- `publish`: put a payload in the registry the way the trainer does (ref as a top-level argument).
- `peft_reference`: greedy tokens + per-token logprobs of the same adapter through PEFT (the truth the
  engine is compared with).
- `small_config`: a Config for 1-2 CPU replicas of the tiny model.

Use from a test module: `from tests._serve_helpers import serve_env  # noqa: F401` (fixture).
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    port = free_port()
    serve.start(http_options={"port": port})
    registry = get_or_create_registry(keep=100)  # tests decide what is live, not trimming
    try:
        yield ServeEnv(model_dir=tiny_model_dir, registry=registry, tmp=tmp_path_factory.mktemp("serve"),
                       http_port=port)
    finally:
        serve.shutdown()
        ray.shutdown()


def small_config(model_dir, replicas: int = 1, max_staleness: int = 1, max_loras: int | None = None,
                 cpus_per_replica: float = 1.0, max_lora_rank: int = 8, **rollout):
    from common.config import Config

    cfg = Config()
    cfg.model.path = str(model_dir)
    cfg.model.dtype = "float32"
    cfg.model.max_model_len = 512
    cfg.rollout.replicas = replicas
    cfg.rollout.cpus_per_replica = cpus_per_replica
    cfg.rollout.max_num_seqs = 16
    cfg.rollout.max_lora_rank = max_lora_rank
    for k, v in rollout.items():
        setattr(cfg.rollout, k, v)
    if os.environ.get("LORA_GRPO_TEST_GPU") == "1":  # the same suites on a GPU machine (vllm 0.25.1)
        cfg.train.use_gpu = True
        # A GPU each when there are enough (two engines profiling one device at once failed to deploy
        # on vllm 0.25.1); otherwise shares of one.
        share = 1.0 if torch.cuda.device_count() >= replicas else round(0.9 / replicas, 3)
        cfg.rollout.gpus_per_replica = share
        cfg.rollout.gpu_memory_utilization = 0.4 if share == 1.0 else round(0.8 / replicas, 3)
    cfg.sync.max_staleness = max_staleness
    cfg.sync.max_loras = max_loras
    return cfg


def _base_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def make_lora_payload(model_dir, seed: int, rank: int = 8, alpha: float = 16.0, b_std: float = 0.3,
                      targets=TARGETS) -> tuple[dict[str, torch.Tensor], dict]:
    """A PEFT LoRA state dict with random non-zero A and B, and its publish metadata."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    from common.adapter_io import make_meta, peft_config_to_dict

    torch.manual_seed(seed)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0)
    model = get_peft_model(_base_model(model_dir), cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * b_std)
    tensors = {k: v.detach().clone().contiguous() for k, v in get_peft_model_state_dict(model).items()}
    pc = peft_config_to_dict(model.peft_config["default"])
    pc["base_model_name_or_path"] = str(model_dir)
    return tensors, make_meta(tensors, pc, kind="adapter")


def make_merged_payload(model_dir, tensors: dict, meta: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Fold a LoRA payload into the base weights (what merge mode publishes): full HF-named tensors."""
    from common.adapter_io import make_meta

    model = _peft_model(model_dir, tensors, meta).merge_and_unload()
    full = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        full.pop("lm_head.weight", None)  # tied: the embedding carries it
    return full, make_meta(full, None, kind="merged")


def _peft_model(model_dir, tensors, meta):
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    pc = {k: v for k, v in meta["peft_config"].items() if k in LoraConfig.__dataclass_fields__}
    model = get_peft_model(_base_model(model_dir), LoraConfig(**pc))
    res = set_peft_model_state_dict(model, tensors)
    assert not [k for k in res.unexpected_keys if "lora" in k], res.unexpected_keys
    return model.eval()


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


def publish(registry, version: int, tensors: dict, meta: dict) -> dict:
    """Publish like the trainer: the ObjectRef is a top-level argument, so the registry re-puts it."""
    import ray

    return ray.get(registry.publish.remote(version, ray.put(tensors), meta))


def prompt_ids(model_dir, text: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False)


def deploy_replicas(cfg, app_name: str = "replicas-test"):
    """Run RolloutReplica alone as a Serve app (no HTTP route) and return its DeploymentHandle."""
    from ray import serve

    from common.registry import NAMESPACE, REGISTRY_NAME
    from serve_deployments.engine_config import engine_kwargs, replica_options
    from serve_deployments.replica import RolloutReplica

    app = RolloutReplica.options(**replica_options(cfg)).bind(engine_kwargs(cfg), REGISTRY_NAME, NAMESPACE,
                                                              cfg.max_loras)
    return serve.run(app, name=app_name, route_prefix=None)


class Versions:
    """Hands out fresh, increasing version numbers (the registry never accepts one twice)."""

    def __init__(self, start: int = 1):
        self.next = start

    def take(self, n: int = 1) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def retire_all(registry) -> None:
    """Take every version out of the live set (so later replica starts load nothing)."""
    import ray

    for v in ray.get(registry.live_versions.remote()):
        ray.get(registry.retire.remote(v))


def replica_actor_names(app_name: str) -> list[str]:
    """Ray actor names of a Serve app's replicas (namespace "serve"), e.g. to ray.kill one."""
    import ray

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == "serve" and a["name"].startswith("SERVE_REPLICA::") and f"{app_name}#" in a["name"]]
