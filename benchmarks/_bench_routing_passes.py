"""benchmarks/bench_routing.py's passes: the workload (prompts with a shared system prompt, the schedule of
passes and adapter versions) and one policy's run on a fresh service: its start, the throughput pass through
generate_group, the streaming TTFT pass, vLLM's and the router's counters over them, and the cache affinity
implied by where the engine served each request."""
from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from app.tiny_model import serve_config
from benchmarks._common import cpu_s_between, delete_app, process_tree_cpu_s, ratio, summary

# name -> (router.policy, router.skip_generic). prefix_plain = the same RoutingPolicy with skip_generic=False:
# plain longest match from the first block.
POLICIES = {"prefix": ("prefix", True), "prefix_plain": ("prefix", False), "round_robin": ("round_robin", True),
            "serve_default": ("serve_default", True)}


# ---------------------------------------------------------------------------------------- workload


def build_workload(args, model_dir: Path, block_size: int) -> dict:
    """Token-id prompts: shared system prompt + unique questions; the schedule of (pass, prompt, version)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    special = set(tok.all_special_ids)
    vocab = [i for i in range(len(tok)) if i not in special]
    rng = random.Random(args.seed)
    # Neither part is block aligned (as with real templates): the block where the system prompt ends
    # already belongs to one question.
    sys_len = args.system_blocks * block_size + block_size // 3
    q_len = args.question_blocks * block_size + block_size // 2
    system = [rng.choice(vocab) for _ in range(sys_len)]
    prompts = [system + [rng.choice(vocab) for _ in range(q_len)] for _ in range(args.prompts)]
    ttft_prompts = [system + [rng.choice(vocab) for _ in range(q_len)] for _ in range(args.ttft_groups)]
    schedule = []  # (pass, prompt index, version); the version alternates per group and flips per pass
    for e in range(args.epochs):
        order = list(range(args.prompts))
        random.Random(args.seed * 1000 + e).shuffle(order)
        for p in order:
            schedule.append((e, p, 1 + (p + e) % 2))
    warm = [rng.choice(vocab) for _ in range(block_size // 2)]  # < 1 block: warms the path, caches nothing
    return {"system": system, "prompts": prompts, "ttft_prompts": ttft_prompts, "schedule": schedule,
            "warmup": warm, "block_size": block_size, "system_tokens": sys_len, "question_tokens": q_len,
            "prompt_tokens": sys_len + q_len}


# ---------------------------------------------------------------------------------------- one policy


def start(args, model_dir: Path, registry, port: int, name: str):
    from serve_deployments import app_builder

    policy, skip_generic = POLICIES[name]
    cfg = serve_config(model_dir, replicas=args.replicas, cpus_per_replica=args.cpus_per_replica,
                       kv_cache_gib=args.kv_cache_gib, max_num_seqs=args.max_num_seqs)
    cfg = cfg.replace(model={"max_model_len": args.max_model_len},
                      rollout={"http_port": port, "app_name": app_name(name)},
                      router={"policy": policy, "skip_generic": skip_generic})
    handle = app_builder.start_service(cfg, registry=registry)
    app_builder.wait_healthy(handle, timeout_s=args.start_timeout)
    return cfg, handle


def app_name(policy: str) -> str:
    return f"routing-{policy.replace('_', '-')}"


def _counters(stats: dict) -> dict:
    r = stats["router"]
    per = {str(s["replica_id"]): (s.get("prefix_cache_hits", 0), s.get("prefix_cache_queries", 0))
           for s in stats["replicas"]}
    return {"hits": stats["prefix_cache_hits"], "queries": stats["prefix_cache_queries"], "per_replica": per,
            "router": {k: r.get(k, 0) for k in ("requests", "affinity", "spill", "unmatched", "round_robin",
                                                 "predicted_hit_blocks", "cacheable_blocks", "generic_blocks",
                                                 "rerouted")} if "requests" in r else None}


def _delta(a: dict, b: dict) -> dict:
    out = {"hits": b["hits"] - a["hits"], "queries": b["queries"] - a["queries"]}
    out["hit_rate"] = out["hits"] / out["queries"] if out["queries"] else None
    out["per_replica"] = {k: {"hits": v[0] - a["per_replica"].get(k, (0, 0))[0],
                              "queries": v[1] - a["per_replica"].get(k, (0, 0))[1]}
                          for k, v in b["per_replica"].items()}
    if b["router"] is not None:
        r = {k: b["router"][k] - (a["router"] or {}).get(k, 0) for k in b["router"]}
        n = max(1, r["requests"])
        r.update({"affinity_rate": r["affinity"] / n, "spill_rate": r["spill"] / n,
                  "unmatched_rate": r["unmatched"] / n,
                  "predicted_hit_rate": r["predicted_hit_blocks"] / max(1, r["cacheable_blocks"])})
        out["router"] = r
    else:
        out["router"] = None
    return out


def _leading_held(hashes: list, held: set) -> int:
    """How many of a prompt's chained block hashes, from the first, a cache holding `held` has."""
    n = 0
    for x in hashes:
        if x not in held:
            break
        n += 1
    return n


def placement(groups: list[dict], wl: dict, G: int) -> dict:
    """Affinity and implied cache hits from where the engine served each request (replica id in each
    response), groups in the order they were started: on a replica, the first request of a (prompt,
    adapter) prefix fills it, every later one (same group or later) finds it."""
    from serve_deployments.prefix_hash import block_hashes, cacheable_blocks

    bs = wl["block_size"]
    held: dict[str, set] = {}  # replica -> block hashes it has been given
    seen: dict[str, set] = {}  # replica -> (prompt, version) prefixes it has been given
    first = {"hit": 0, "n": 0}
    revisit = {"hit": 0, "n": 0}
    ever: set = set()
    implied_hits = queried = ideal_hits = 0
    ideal_held: set = set()  # one replica holding everything: the ceiling for any routing
    for g in sorted(groups, key=lambda g: g["t_start"]):
        key = (g["prompt"], g["version"])
        toks = g["tokens"]
        hashes = block_hashes(toks, bs, f"policy-v{g['version']}")
        cap = cacheable_blocks(len(toks), bs)
        bucket = revisit if key in ever else first
        ever.add(key)
        for rid in g["replicas"]:
            h = held.setdefault(rid, set())
            implied_hits += _leading_held(hashes[:cap], h) * bs
            ideal_hits += _leading_held(hashes[:cap], ideal_held) * bs
            queried += len(toks)
            s = seen.setdefault(rid, set())
            bucket["n"] += 1
            bucket["hit"] += key in s
            s.add(key)
            h.update(hashes)
            ideal_held.update(hashes)
    n_all = first["n"] + revisit["n"]
    return {"affinity_first_sight": first["hit"] / first["n"] if first["n"] else None,
            "affinity_revisit": revisit["hit"] / revisit["n"] if revisit["n"] else None,
            "affinity_all": (first["hit"] + revisit["hit"]) / n_all if n_all else None,
            "first_sight_requests": first["n"], "revisit_requests": revisit["n"],
            "first_sight_ceiling": (G - 1) / G,
            "implied_hit_tokens": implied_hits, "queried_tokens": queried,
            "implied_hit_rate": implied_hits / queried if queried else None,
            "ideal_hit_rate": ideal_hits / queried if queried else None}


def throughput_pass(args, handle, wl: dict) -> tuple[list[dict], float]:
    sampling = {"max_tokens": args.max_tokens, "temperature": 1.0, "ignore_eos": True}
    lock = threading.Lock()
    todo = list(enumerate(wl["schedule"]))
    groups: list[dict] = []

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                i, (e, p, v) = todo.pop(0)
            toks = wl["prompts"][p]
            t0 = time.perf_counter()
            outs = handle.generate_group.remote(toks, args.group, v, sampling).result(timeout_s=600)
            t1 = time.perf_counter()
            assert all(o["version"] == v for o in outs), "served under another version"
            with lock:
                groups.append({"i": i, "pass": e, "prompt": p, "version": v, "tokens": toks, "t_start": t0,
                               "latency_s": t1 - t0, "replicas": [str(o["replica_id"]) for o in outs],
                               "output_tokens": sum(len(o["token_ids"]) for o in outs)})

    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as ex:
        for f in [ex.submit(worker) for _ in range(args.concurrency)]:
            f.result()
    return groups, time.perf_counter() - t0


async def _ttft_pass(args, port: int, wl: dict) -> dict:
    import aiohttp

    url = f"http://127.0.0.1:{port}/v1/completions"
    sem = asyncio.Semaphore(args.concurrency)
    reqs: list[dict] = []

    async def one(session, toks, version):
        body = {"model": f"policy-v{version}", "prompt": toks, "max_tokens": args.max_tokens, "temperature": 1.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        ttft, usage, err = None, None, None
        async with session.post(url, json=body) as r:
            if r.status != 200:
                err = f"HTTP {r.status}: {(await r.text())[:200]}"
            else:
                async for line in r.content:
                    line = line.strip()
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    d = json.loads(line[6:])
                    if "error" in d:
                        err = str(d["error"])[:200]
                        break
                    if ttft is None and d.get("choices"):
                        ttft = time.perf_counter() - t0
                    if d.get("usage"):
                        usage = d["usage"]
        reqs.append({"ttft_s": ttft, "latency_s": time.perf_counter() - t0, "usage": usage, "error": err})

    async def group(session, gi):
        async with sem:
            toks = wl["ttft_prompts"][gi]
            await asyncio.gather(*[one(session, toks, 1 + gi % 2) for _ in range(args.group)])

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*[group(session, gi) for gi in range(len(wl["ttft_prompts"]))])
    wall = time.perf_counter() - t0
    errors = [r["error"] for r in reqs if r["error"]]
    ok = [r for r in reqs if not r["error"] and r["ttft_s"] is not None]
    out_toks = sum((r["usage"] or {}).get("completion_tokens", 0) for r in ok)
    return {"method": "streaming REST /v1/completions, separate pass over fresh questions; TTFT = first SSE chunk",
            "requests": len(reqs), "errors": len(errors), "first_errors": errors[:3],
            "ttft_s": summary([r["ttft_s"] for r in ok]), "latency_s": summary([r["latency_s"] for r in ok]),
            "wall_s": wall, "output_tokens": out_toks}


def run_policy(args, name: str, model_dir: Path, registry, port: int, wl_box: dict) -> dict:
    row: dict = {"policy": name, "router_policy": POLICIES[name][0], "skip_generic": POLICIES[name][1],
                 "loadavg_before": os.getloadavg()}
    t0 = time.perf_counter()
    try:
        _, handle = start(args, model_dir, registry, port, name)
        row["start_s"] = time.perf_counter() - t0
        st = handle.stats.remote().result()
        bs = {s["block_size"] for s in st["replicas"]}
        assert len(bs) == 1 and len(st["replicas"]) == args.replicas, st["replicas"]
        bs = bs.pop()
        if "wl" not in wl_box:
            wl_box["wl"] = build_workload(args, model_dir, bs)
        wl = wl_box["wl"]
        assert wl["block_size"] == bs, (wl["block_size"], bs)
        print(f"  {name}: {args.replicas} replicas up in {row['start_s']:.1f}s (block size {bs}, live "
              f"{st['live_versions']})", flush=True)
        # Warm the request path under both adapters with a sub-block prompt: nothing gets cached.
        for v in (1, 2):
            handle.generate_group.remote(wl["warmup"], args.group, v, {"max_tokens": 2, "ignore_eos": True}).result()
        st0 = handle.stats.remote().result()
        pids = [s["pid"] for s in st0["replicas"]]
        cpu0 = process_tree_cpu_s(pids)
        c0 = _counters(st0)
        groups, wall = throughput_pass(args, handle, wl)
        cpu1 = process_tree_cpu_s(pids)
        cpu_s = cpu_s_between(cpu0, cpu1)
        c1 = _counters(handle.stats.remote().result())
        eng = _delta(c0, c1)
        prompt_toks = sum(len(g["tokens"]) * args.group for g in groups)
        out_toks = sum(g["output_tokens"] for g in groups)
        per_rep: dict[str, int] = {}
        for g in groups:
            for r in g["replicas"]:
                per_rep[r] = per_rep.get(r, 0) + 1
        pl = placement(groups, wl, args.group)
        pl["implied_over_engine_hits"] = ratio(pl["implied_hit_tokens"], eng["hits"])
        if eng["router"] is not None:  # the router counts blocks of the cacheable part; in tokens for comparison
            eng["router"]["predicted_hit_rate_tokens"] = eng["router"]["predicted_hit_blocks"] * bs / prompt_toks
        row.update({
            "groups": len(groups), "requests": len(groups) * args.group, "wall_s": wall,
            "prompt_tokens": prompt_toks, "output_tokens": out_toks,
            "tokens_per_s": (prompt_toks + out_toks) / wall, "output_tokens_per_s": out_toks / wall,
            "computed_prompt_tokens": eng["queries"] - eng["hits"],
            "replica_cpu_s": cpu_s, "replica_processes": len(cpu1),
            "tokens_per_replica_cpu_s": (prompt_toks + out_toks) / cpu_s if cpu_s > 0 else None,
            "group_latency_s": summary([g["latency_s"] for g in groups]),
            "engine": eng, "placement": pl, "requests_per_replica": per_rep,
            "router": eng["router"],
        })
        c2 = _counters(handle.stats.remote().result())
        row["ttft"] = asyncio.run(_ttft_pass(args, port, wl))
        row["ttft"]["engine"] = _delta(c2, _counters(handle.stats.remote().result()))
        row["loadavg_after"] = os.getloadavg()
        r = row["router"] or {}
        print(f"  {name}: {row['requests']} requests in {wall:.1f}s, {row['tokens_per_s']:.0f} tok/s, engine hit "
              f"{eng['hit_rate']:.3f}, affinity (first sight) {pl['affinity_first_sight']:.3f}"
              + (f", spill {r['spill_rate']:.3f}" if r else "")
              + f", TTFT p50 {row['ttft']['ttft_s']['p50'] * 1e3:.0f} ms", flush=True)
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:400]
        print(f"  {name}: failed: {row['error']}", flush=True)
    finally:
        delete_app(app_name(name))
    return row
