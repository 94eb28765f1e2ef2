"""benchmarks/bench_adapter_sync.py's part (b), the transport path: synthetic payloads shaped like
Qwen2.5-1.5B (adapters at several ranks, the merged weights of the first layers) published through the real
AdapterRegistry to engine-less Serve replicas that run the replica's own weight transports."""
from __future__ import annotations

import os
import time
from pathlib import Path

from benchmarks._bench_adapter_sync_full import perturbed
from benchmarks._common import delete_app, summary
from common.adapter_io import pack_tensors, unpack_tensors
from common.lora_payloads import TARGETS

QWEN15B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
               num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
               rope_theta=1000000.0)
TRANSPORT_APP = "adapter-sync-transport"
TRANSPORT_REGISTRY = "adapter-sync-transport-registry"


# ---------------------------------------------------------------------------------------- (b) transport


def _transport_deployments():
    """Defined inside a function so Serve pickles them by value: the replicas need not import this module (the
    script runs as __main__, and workers may lack the repository's path)."""
    from ray import serve

    class NoEngine:
        """The engine calls of the weight transports, doing nothing: what is timed is everything else."""

        async def add_lora(self, request) -> None:
            pass

        async def remove_lora(self, lora_id: int) -> None:
            pass

        async def collective_rpc(self, method: str, args=()) -> None:
            pass

        async def reset_prefix_cache(self) -> None:
            pass

    @serve.deployment(ray_actor_options={"num_cpus": 0.1})
    class SinkReplica:
        """RolloutReplica's load path with the engine left out: the replica's own weight transports
        (serve_deployments/engine_weights.py) over `NoEngine`. Adapter: `AdapterTransport.load` (verify
        against the base config, slot digest check, evict the slots' victim, write the PEFT dir to tmpfs,
        register). Merged: `MergedTransport.stage` (verify, write the safetensors file) and `swap`, then the
        adapters dropped, as `update_weights` does. `merged_layers`: the merged payloads carry only the
        first N decoder layers, so the shapes checked for completeness are those layers'."""

        def __init__(self, registry_name: str, namespace: str, model_dir: str, max_rank: int, max_loras: int,
                     merged_layers: int):
            import ray

            from serve_deployments.adapter_files import BaseModelShapes, scratch_root
            from serve_deployments.adapter_slots import AdapterSlots
            from serve_deployments.engine_weights import AdapterTransport, MergedTransport

            self._registry = ray.get_actor(registry_name, namespace=namespace)
            shapes = BaseModelShapes(model_dir)
            merged_shapes = BaseModelShapes(model_dir)
            layers = tuple(f"model.layers.{i}." for i in range(merged_layers))
            merged_shapes.params = {n: s for n, s in shapes.params.items() if n.startswith(layers)}
            self._scratch = scratch_root("bench-sink")
            engine = NoEngine()
            self._adapters = AdapterTransport(engine, AdapterSlots(max_loras), shapes, self._scratch, max_rank,
                                              lora_request=lambda name, int_id, path: (name, int_id, path))
            self._merged = MergedTransport(engine, merged_shapes, self._scratch)

        async def load_adapter(self, version: int) -> dict:
            from serve_deployments.engine_weights import payload_kind

            t0 = time.perf_counter()
            entry = await self._registry.get.remote(version)
            t1 = time.perf_counter()
            tensors = unpack_tensors(await entry["ref"][0])
            t2 = time.perf_counter()
            meta = entry["meta"]
            if payload_kind(meta) == "merged":
                path = self._merged.stage(version, tensors, meta)
                await self._merged.swap(version, path, meta.get("sha256"))
                await self._adapters.evict_all()
            else:
                await self._adapters.load(version, tensors, meta)
            t3 = time.perf_counter()
            del tensors
            return {"registry_get_s": t1 - t0, "fetch_s": t2 - t1, "load_s": t3 - t2, "replica_total_s": t3 - t0,
                    "pid": os.getpid()}

        def __del__(self):
            from serve_deployments.adapter_files import remove_dir

            if getattr(self, "_scratch", None) is not None:
                remove_dir(self._scratch)

    @serve.deployment(ray_actor_options={"num_cpus": 0.1})
    class SinkRouter:
        """The ingress' load_adapter: broadcast to every replica, all must acknowledge."""

        def __init__(self, replica):
            self._replica = replica
            self._results: dict[int, dict] = {}

        async def load_adapter(self, version: int) -> dict:
            t0 = time.perf_counter()
            results = await self._replica.broadcast("load_adapter", version).results_async(timeout_s=600)
            out = {"broadcast_s": time.perf_counter() - t0, "replicas": results}
            self._results = {version: out}
            return out

        async def result_of(self, version: int) -> dict:
            return self._results[version]

    return SinkReplica, SinkRouter


def qwen15b_config_dir(root: Path) -> Path:
    from transformers import Qwen2Config

    d = root / "qwen2.5-1.5b-shape"
    Qwen2Config(**QWEN15B, torch_dtype="bfloat16").save_pretrained(d)
    return d


def synthetic_adapter(shapes, rank: int, layers: int) -> tuple[dict, dict]:
    import torch

    gen = torch.Generator().manual_seed(rank)
    tensors = {}
    for i in range(layers):
        for mod in TARGETS:
            grp = "self_attn" if mod in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"model.layers.{i}.{grp}.{mod}"
            fan_in, fan_out = shapes.linear[name]
            tensors[f"base_model.model.{name}.lora_A.weight"] = (
                torch.randn(rank, fan_in, generator=gen) * 0.01
            ).to(torch.bfloat16)
            tensors[f"base_model.model.{name}.lora_B.weight"] = (
                torch.randn(fan_out, rank, generator=gen) * 0.01
            ).to(torch.bfloat16)
    peft_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
                   "lora_dropout": 0.0, "bias": "none", "target_modules": TARGETS,
                   "base_model_name_or_path": "Qwen2.5-1.5B-shaped (synthetic)"}
    return tensors, peft_config


def synthetic_merged(shapes, layers: int) -> dict:
    import torch

    torch.manual_seed(0)
    prefixes = tuple(f"model.layers.{i}." for i in range(layers))
    return {n: torch.empty(s, dtype=torch.bfloat16).normal_(0, 0.02) for n, s in shapes.params.items()
            if n.startswith(prefixes)}


def full_merged_nbytes(shapes) -> int:
    import math

    return sum(2 * math.prod(s) for n, s in shapes.params.items() if n not in shapes.optional)


def transport(args, tmp: Path) -> dict:
    import ray
    from ray import serve

    from common.adapter_io import make_meta, tensors_nbytes
    from common.registry import NAMESPACE, AdapterRegistry
    from serve_deployments.adapter_files import BaseModelShapes

    model_dir = qwen15b_config_dir(tmp)
    shapes = BaseModelShapes(str(model_dir))
    full_bytes = full_merged_nbytes(shapes)
    n_layers = QWEN15B["num_hidden_layers"]
    registry = AdapterRegistry.options(name=TRANSPORT_REGISTRY, namespace=NAMESPACE).remote(keep=2)
    SinkReplica, SinkRouter = _transport_deployments()
    # Two slots, as a replica under max_staleness 0: every publish after the second evicts one (the
    # registry, keep=2, retires the oldest version at the same time).
    app = SinkRouter.bind(SinkReplica.options(num_replicas=args.transport_replicas).bind(
        TRANSPORT_REGISTRY, NAMESPACE, str(model_dir), max(args.ranks), 2, args.merged_layers))
    t0 = time.perf_counter()
    handle = serve.run(app, name=TRANSPORT_APP, route_prefix=None)
    ray.get(registry.attach_ingress.remote(TRANSPORT_APP))
    out = {"replicas": args.transport_replicas, "model": "Qwen2.5-1.5B shape (synthetic bf16)", "config": QWEN15B,
           "start_s": time.perf_counter() - t0, "full_merged_nbytes": full_bytes, "payloads": {}}
    print(f"  transport app up ({args.transport_replicas} sink replicas) in {out['start_s']:.1f}s", flush=True)
    version = 1
    cases = [(f"adapter_r{r}", r) for r in args.ranks] + [("merged", None)]
    try:
        for name, rank in cases:
            if rank is None:
                base, peft_config, kind, n = (
                    synthetic_merged(shapes, args.merged_layers), None, "merged", args.merged_publishes
                )
            else:
                (base, peft_config), kind, n = (
                    synthetic_adapter(shapes, rank, n_layers), "adapter", args.transport_publishes
                )
            nbytes = tensors_nbytes(base)
            recs = []
            for i in range(n + 1):  # first one: warm-up
                tensors = perturbed(base, version)
                t_d = time.perf_counter()
                meta = make_meta(tensors, peft_config, kind=kind)
                t_p = time.perf_counter()
                ref = ray.put(pack_tensors(tensors))
                t_q = time.perf_counter()
                rec = ray.get(registry.publish.remote(version, ref, meta))
                t_r = time.perf_counter()
                del ref, tensors
                res = handle.result_of.remote(version).result()
                reps = res["replicas"]
                if len(reps) != args.transport_replicas:
                    raise RuntimeError(
                        f"{name} v{version}: {len(reps)} of {args.transport_replicas} replicas acknowledged"
                    )
                r = {"digest_s": t_p - t_d, "put_s": t_q - t_p, "publish_s": t_r - t_q,
                     "arg_transfer_s": (t_r - t_q) - rec["seconds"],
                     "registry_reput_s": rec["seconds"] - rec["replica_load_seconds"],
                     "broadcast_s": rec["replica_load_seconds"],
                     **{k: max(x[k] for x in reps) for k in ("registry_get_s", "fetch_s", "load_s", "replica_total_s")},
                     "total_s": t_r - t_p, "total_with_digest_s": t_r - t_d}
                if i:
                    recs.append(r)
                version += 1
            row = {"kind": kind, "rank": rank, "nbytes": nbytes,
                   "bytes_moved": nbytes * (2 + args.transport_replicas),
                   **{k: summary([x[k] for x in recs]) for k in recs[0]}, "samples": recs}
            if kind == "merged":
                row["layers_measured"] = args.merged_layers
                row["scale_to_full"] = full_bytes / nbytes
            out["payloads"][name] = row
            print(f"  {name:<11} {nbytes / 2**20:9.1f} MiB: total p50 {row['total_s']['p50']:.3f}s "
                  f"p95 {row['total_s']['p95']:.3f}s", flush=True)
            del base
    finally:
        delete_app(TRANSPORT_APP)
        ray.kill(registry)
    m = out["payloads"]["merged"]
    scale = m["scale_to_full"]
    extra = {k: {q: v[q] * scale for q in ("p50", "p95", "mean")} | {"n": v["n"]}
             for k, v in m.items() if isinstance(v, dict) and "p50" in v}
    out["payloads"]["merged_full_extrapolated"] = {"kind": "merged", "rank": None, "nbytes": full_bytes,
                                                   "bytes_moved": full_bytes * (2 + args.transport_replicas),
                                                   "extrapolated_from_layers": args.merged_layers,
                                                   "scale": scale, **extra}
    for r in out["payloads"].values():
        if r["kind"] == "adapter":
            r["bytes_ratio_merged_over_adapter"] = full_bytes / r["nbytes"]
    return out
