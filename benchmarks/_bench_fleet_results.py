"""benchmarks/bench_fleet.py's results: two calls' results merged (--modes, --merge-into, --seq-from), the
sequential K's built from the runs, the analysis against the goals, the table and the plot."""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks._common import summary

GOAL_RATIO, GOAL_Z, GOAL_SHARE_DEV = 0.7, 3.0, 0.15
# What a merged file and this call must agree on, or the modes would not measure the same runs.
SAME_SETUP = ("recipe", "steps", "replicas", "gpu_fraction", "samples_per_row", "lease_s")


def _p(xs: list[float]) -> dict:
    s = summary(xs)
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in s.items()}


# ---------------------------------------------------------------------------------------- results, merged


SHARED_KEYS = ("fleet_start_s", "fleet_error", "fleet_down_error")


def merge_results(old: dict, new: dict, modes: list[str]) -> dict:
    """`old` (an earlier call's results) with this call's: its shared K's and sequential runs replace the
    earlier ones of the same K / run; the fleet's start and errors are the latest shared call's."""
    out = {"shared": {**old.get("shared", {}), **new["shared"]},
           "sequential_runs": sorted({**{r["name"]: r for r in old.get("sequential_runs", [])},
                                      **{r["name"]: r for r in new["sequential_runs"]}}.values(),
                                     key=lambda r: r["seed"])}
    for key in SHARED_KEYS:
        src = new if "shared" in modes else old
        if key in src:
            out[key] = src[key]
    for key in ("cluster_cpus", "cluster_gpus"):
        out[key] = new.get(key, old.get(key))
    return out


def with_sequential(res: dict, ks: list[int]) -> dict:
    """res["sequential"][K]: runs 0..K-1 one after another, for every K whose runs are all there."""
    by_seed = {r["seed"]: r for r in res["sequential_runs"]}
    seq = {}
    for k in ks:
        if all(i in by_seed for i in range(k)):
            walls = [by_seed[i]["wall_s"] for i in range(k)]
            seq[k] = {"wall_s": round(sum(walls), 1) if None not in walls else None,
                      "runs": [by_seed[i] for i in range(k)]}
    return {**res, "sequential": seq}


def read_merge(path: Path) -> dict:
    """An earlier call's JSON, its K keys ints again (JSON made them strings)."""
    doc = json.loads(path.read_text())
    res = doc["results"]
    res["shared"] = {int(k): v for k, v in res.get("shared", {}).items()}
    res.setdefault("sequential_runs", [])
    return doc


def setup_mismatch(old: dict, new: dict) -> list[str]:
    return [f"{k}: {old.get(k)!r} in the merged file, {new.get(k)!r} here" for k in SAME_SETUP
            if old.get(k) != new.get(k)]


def analyse(res: dict, ks: list[int]) -> dict:
    """Ratios, z, shares and sync latency per K, and the goals."""
    per_k = {}
    for k in ks:
        sh, sq = res["shared"].get(k), res["sequential"].get(k)
        row: dict = {}
        if sh and sq and sq["wall_s"]:
            row["wall_ratio_shared_over_sequential"] = round(sh["wall_s"] / sq["wall_s"], 3)
            start = res.get("fleet_start_s") or 0
            row["wall_ratio_with_fleet_start"] = round((sh["wall_s"] + start) / sq["wall_s"], 3)
        for mode, m in (("shared", sh), ("sequential", sq)):
            if not m:
                continue
            row[f"{mode}_wall_s"] = m["wall_s"]
            row[f"{mode}_z"] = {r["name"]: r["reward_z"] for r in m["runs"]}
            row[f"{mode}_all_finished"] = all(r["finished"] for r in m["runs"])
            row[f"{mode}_publish_to_served_s"] = _p([x for r in m["runs"] for x in r["publish_to_served_s"]])
        if sh:
            row["share_max_rel_dev"] = sh["shares"]["max_rel_dev_all_attached"]
            if row["share_max_rel_dev"] is None:
                row["share_max_rel_dev"] = sh["shares"]["max_rel_dev_last_seen"]
        per_k[k] = row
    zs = [z for row in per_k.values() for mode in ("shared", "sequential") for z in row.get(f"{mode}_z", {}).values()]
    devs = [row["share_max_rel_dev"] for k, row in per_k.items() if k > 1 and "share_max_rel_dev" in row]
    k2 = per_k.get(2, {}).get("wall_ratio_shared_over_sequential")
    targets = {"wall_ratio_le_0.7_at_k2": None if k2 is None else k2 <= GOAL_RATIO,
               "every_z_gt_3": bool(zs) and all(z is not None and z > GOAL_Z for z in zs),
               "shares_within_15pct": None if not devs else all(d is not None and d <= GOAL_SHARE_DEV for d in devs)}
    return {"per_k": per_k, "targets_met": targets}


def print_table(doc: dict) -> None:
    print(f"\nmany runs, one fleet: {doc['steps']} steps per run, {doc['replicas']} replica(s), "
          f"fleet start {doc.get('fleet_start_s')}s (counted apart), {doc['machine']}")
    print(f"{'K':>2} {'shared s':>9} {'seq s':>7} {'ratio':>6} {'+start':>7} {'max share dev':>14} "
          f"{'sync p50 shared/seq':>20}  z (shared | sequential)")
    for k, row in doc["per_k"].items():
        def f(x, fmt):
            return format(x, fmt) if isinstance(x, (int, float)) else "-".rjust(int(fmt.split(".")[0] or 0))
        sync = (f"{f(row.get('shared_publish_to_served_s', {}).get('p50'), '.3f')}/"
                f"{f(row.get('sequential_publish_to_served_s', {}).get('p50'), '.3f')}")
        zs = " ".join(f(z, ".1f") for z in row.get("shared_z", {}).values())
        zq = " ".join(f(z, ".1f") for z in row.get("sequential_z", {}).values())
        print(f"{k:>2} {f(row.get('shared_wall_s'), '9.0f')} {f(row.get('sequential_wall_s'), '7.0f')} "
              f"{f(row.get('wall_ratio_shared_over_sequential'), '6.2f')} "
              f"{f(row.get('wall_ratio_with_fleet_start'), '7.2f')} {f(row.get('share_max_rel_dev'), '14.3f')} "
              f"{sync:>20}  {zs} | {zq}")
    for k, m in doc["results"]["shared"].items():
        sh = m["shares"]
        print(f"K={k} shares (fair {sh['fair']}): all attached {sh['share_all_attached']}, "
              f"last seen {sh['share_last_seen']}")
    print(f"targets: {doc['targets_met']}")


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res, ks = doc["results"], list(doc["per_k"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = list(range(len(ks)))
    shared = [(res["shared"].get(k) or {}).get("wall_s") or 0 for k in ks]
    seq = [(res["sequential"].get(k) or {}).get("wall_s") or 0 for k in ks]
    a.bar([i - 0.2 for i in x], shared, 0.4, label="shared fleet (runs)", color="#2a7")
    a.bar([i - 0.2 for i in x], [doc.get("fleet_start_s") or 0] * len(ks), 0.4, bottom=shared, color="#9d9",
          label="fleet start (once)")
    a.bar([i + 0.2 for i in x], seq, 0.4, label="sequential, own service each", color="#999")
    a.set_xticks(x, [f"K={k}" for k in ks])
    a.set_ylabel("wall seconds")
    a.set_title("K runs: one fleet vs one after another")
    a.legend(fontsize=8)
    curves = [(f"shared K={k} {r['name']}", "-", r) for k, m in res["shared"].items() for r in m["runs"]]
    # Every sequential run once: K runs one after another are the first K of them.
    curves += [(f"sequential {r['name']}", "--", r) for r in res.get("sequential_runs", [])]
    for label, style, r in curves:
        b.plot(range(1, len(r["rewards"]) + 1), r["rewards"], style, label=label)
    b.set_xlabel("step")
    b.set_ylabel("batch reward mean")
    b.set_title("reward per step, each run")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
