"""benchmarks/bench_routing.py's report: the targets, the table printed over the policies, the ratios of
prefix routing to the others and why each target was met or missed, and the plot."""
from __future__ import annotations

from pathlib import Path

from benchmarks._common import ratio

TARGET_AFFINITY = 0.87
TARGET_SPILL = 0.01
TARGET_SPEEDUP = 1.3


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
