"""What the benchmarks share (and the Serve tests import too; tests/_serve_helpers re-exports it): a free
port, percentiles, a small Serve config of the tiny model, LoRA / merged payloads shaped like the
trainer's, publishing them the trainer's way, and the CPU time of a process tree.

Not a test module: nothing here imports pytest or `tests`. Benchmarks import it as `benchmarks._common`
(run from the repository root: `python -m benchmarks.NAME` or `python -m app bench NAME`).
"""
from __future__ import annotations

import os
import socket
from pathlib import Path

# PEFT target modules of the tiny model's LoRA payloads: all 7 projections of a Qwen2 block.
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# Ports handed to servers we start (Serve's HTTP port, a vLLM server) come from below the kernel's
# ephemeral range and above Ray's worker ports (10002-19999): every port Ray binds for itself (a driver's
# gRPC server, agents, the GCS) is an ephemeral one, so a port picked here cannot be taken by Ray between
# the pick and the server's bind. CI lost a whole run to that: the driver's gRPC server got the very port
# picked for Serve a moment before, Serve's proxy never bound, and the module's Ray stayed connected.
_PORTS = (20000, 32767)
_given: set[int] = set()  # a test picks several before starting anything: never the same one twice


def free_port() -> int:
    import random

    lo, hi = _PORTS
    for _ in range(200):
        port = random.randint(lo, hi)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise OSError(f"no free port in {lo}..{hi}")


# ---------------------------------------------------------------------------------------- statistics


def pct(xs, q) -> float:
    import numpy as np

    return float(np.percentile(np.asarray(xs, dtype=float), q)) if xs else float("nan")


def summary(xs) -> dict:
    """p50, p95, mean and count of a list of numbers (NaN when empty)."""
    return {"p50": pct(xs, 50), "p95": pct(xs, 95), "mean": sum(xs) / len(xs) if xs else float("nan"), "n": len(xs)}


def ratio(a, b):
    return a / b if a is not None and b else None


# ---------------------------------------------------------------------------------------- processes


def process_tree_cpu_s(pids) -> dict[int, float]:
    """CPU seconds (user + system, all threads) of each process in `pids` and of all their descendants
    (vLLM's engine core runs in a child process unless VLLM_ENABLE_V1_MULTIPROCESSING=0, and its own
    workers below that), plus the CPU time of children that already exited and were reaped (psutil's
    children_user/children_system). Keyed by pid, so a caller diffs two snapshots per process: a child
    started in between counts in full, one that exited in between counts through its parent."""
    import psutil

    out: dict[int, float] = {}
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for p in procs:
            try:
                t = p.cpu_times()
                out[p.pid] = t.user + t.system + t.children_user + t.children_system
            except psutil.Error:
                pass
    return out


def cpu_s_between(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds a process tree used between two `process_tree_cpu_s` snapshots."""
    return sum(max(0.0, t - before.get(pid, 0.0)) for pid, t in after.items())


def rss_bytes(pid: int) -> int:
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return 0


# ---------------------------------------------------------------------------------------- Serve


def small_config(model_dir, replicas: int = 1, max_staleness: int = 1, max_loras: int | None = None,
                 cpus_per_replica: float = 1.0, max_lora_rank: int = 8, **rollout):
    """A Config for `replicas` CPU vLLM replicas of the model at `model_dir` (float32,
    512-token context, 16 sequences per engine); extra keywords set `rollout.*` keys."""
    from common.config import Config

    return Config(model={"path": str(model_dir), "dtype": "float32", "max_model_len": 512},
                  rollout={"replicas": replicas, "cpus_per_replica": cpus_per_replica, "max_num_seqs": 16,
                           "max_lora_rank": max_lora_rank, **rollout},
                  sync={"max_staleness": max_staleness, "max_loras": max_loras})


def delete_app(name: str) -> None:
    """serve.delete, reporting (not raising) a failure: benchmarks delete their apps in `finally`."""
    from ray import serve

    try:
        serve.delete(name)
    except Exception as e:
        print(f"  (delete {name}: {e})", flush=True)


def publish(registry, version: int, tensors: dict, meta: dict) -> dict:
    """Publish like the trainer: packed into one buffer, the ObjectRef a top-level argument (so the registry
    re-puts it)."""
    import ray

    from common.adapter_io import pack_tensors

    return ray.get(registry.publish.remote(version, ray.put(pack_tensors(tensors)), meta))


def retire_all(registry) -> None:
    """Take every version out of the live set (so later replica starts load nothing)."""
    import ray

    for v in ray.get(registry.live_versions.remote()):
        ray.get(registry.retire.remote(v))


def prompt_ids(model_dir, text: str) -> list[int]:
    """`text` as a user turn under the model's chat template, ready for generation."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False)


# ---------------------------------------------------------------------------------------- payloads


def base_model(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def make_lora_payload(model_dir, seed: int, rank: int = 8, alpha: float = 16.0, b_std: float = 0.3,
                      targets=TARGETS) -> tuple[dict, dict]:
    """A PEFT LoRA state dict with random non-zero A and B (so it visibly changes outputs), and its publish
    metadata: the (tensors, meta) pair the trainer publishes."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    from common.adapter_io import make_meta, peft_config_to_dict

    torch.manual_seed(seed)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0)
    model = get_peft_model(base_model(model_dir), cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * b_std)
    tensors = {k: v.detach().clone().contiguous() for k, v in get_peft_model_state_dict(model).items()}
    pc = peft_config_to_dict(model.peft_config["default"])
    pc["base_model_name_or_path"] = str(model_dir)
    return tensors, make_meta(tensors, pc, kind="adapter")


def peft_model(model_dir, tensors: dict, meta: dict):
    """The base model with a LoRA payload applied through PEFT (the reference the engine is compared with)."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    pc = {k: v for k, v in meta["peft_config"].items() if k in LoraConfig.__dataclass_fields__}
    model = get_peft_model(base_model(model_dir), LoraConfig(**pc))
    res = set_peft_model_state_dict(model, tensors)
    bad = [k for k in res.unexpected_keys if "lora" in k]
    if bad:
        raise ValueError(f"LoRA tensors PEFT did not take: {bad[:3]}")
    return model.eval()


def make_merged_payload(model_dir, tensors: dict, meta: dict) -> tuple[dict, dict]:
    """Fold a LoRA payload into the base weights (what merge mode publishes): full HF-named tensors."""
    from common.adapter_io import make_meta

    model = peft_model(model_dir, tensors, meta).merge_and_unload()
    full = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        full.pop("lm_head.weight", None)  # tied: the embedding carries it
    return full, make_meta(full, None, kind="merged")


def descendant_pids(title_part: str) -> list[int]:
    """PIDs of this process's descendants (the local Ray cluster it started) whose command line holds
    `title_part` (Ray titles a Serve replica process `ray::ServeReplica:APP:DEPLOYMENT...`). Other Ray
    instances on the machine are never looked at."""
    parent: dict[int, int] = {}
    cmd: dict[int, str] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
    me = os.getpid()

    def mine(pid: int) -> bool:
        seen = 0
        while pid > 1 and seen < 64:
            if pid == me:
                return True
            pid, seen = parent.get(pid, 0), seen + 1
        return False

    return [pid for pid, c in cmd.items() if title_part in c and pid != me and mine(pid)]


def run_driver(cfg, gpus: int, progress: bool) -> tuple[dict, str | None, float]:
    """One training run as the GPU benchmarks make it: a local Ray of `gpus` GPUs (PYTHONPATH passed on to
    the workers: the offline GPU bundle lives there), `driver.run`, Ray shut down. Returns (summary, the error
    that ended it or None, wall seconds): the caller's record says how it failed."""
    import time

    import ray

    from app import driver

    ray.init(address="local", num_gpus=gpus, include_dashboard=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false",
                                       "PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    t0 = time.time()
    error = None
    try:
        summary = driver.run(cfg, progress=progress)
    except Exception as e:
        error, summary = f"{type(e).__name__}: {e}"[-3000:], {}
    wall = time.time() - t0
    ray.shutdown()
    return summary, error, wall
