"""Async vs sync GRPO on the same work: the tiny recipe, the same number of steps and samples, once
with rollouts running ahead of the trainer (async, max_staleness versions) and once alternating
generate -> train (sync). Real Ray, Serve, vLLM and DeepSpeed, local cluster.

    python -m app bench async_vs_sync                 # 24 steps each, max_staleness 4
    python -m app bench async_vs_sync --quick         # 3 steps each, one replica, one train worker (smoke)

Prints a table and writes benchmarks/results/async_vs_sync.json and .png (steps/hour and reward).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# --quick: the same two runs at the smallest size that still runs both sides (start-up dominates them).
QUICK = ["rollout.replicas=1", "train.num_workers=1", "rollout.workers=1", "eval.path=null", "grpo.prompts_per_step=8"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--max-staleness", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=16, help="longer completions balance generation vs training")
    p.add_argument("--quick", action="store_true", help="3 steps each on one replica and one train worker, no "
                                                         "evaluation: a smoke check, not a measurement")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config overrides")
    args = p.parse_args(argv)
    steps = 3 if args.quick else args.steps

    import ray

    from app import driver
    from app.tiny_model import ensure_model
    from common import config as C

    work = Path(tempfile.mkdtemp(prefix="bench-async-"))
    model = ensure_model(REPO / "runs" / "tiny-model")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false",
                                       "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "600"}})
    results = {}
    try:
        for mode in ("sync", "async"):
            cfg = C.load(str(REPO / "recipes" / "tiny-cpu.yaml"), [
                f"model.path={model}", "model.build_tiny=false", f"run.out_dir={work}", f"run.name={mode}",
                f"run.mode={mode}", f"train.total_steps={steps}", "checkpoint.every=0",
                f"sync.max_staleness={args.max_staleness}", f"grpo.max_new_tokens={args.max_new_tokens}",
                *(QUICK if args.quick else []), *args.set])
            t0 = time.time()
            s = driver.run(cfg, progress=True)
            rows = [json.loads(line) for line in (work / mode / "metrics.jsonl").read_text().splitlines()]
            # steady state: steps 2..N (step 1 waits for engine and trainer warm-up in both modes)
            steady_wall = rows[-1]["time"] - rows[0]["time"]
            results[mode] = {
                "steps": s["steps"], "steady_wall_seconds": steady_wall, "total_seconds": time.time() - t0,
                "steps_per_hour": 3600.0 * (len(rows) - 1) / steady_wall if steady_wall > 0 else None,
                "trainer_idle_fraction": s["trainer_idle_fraction"],
                "generation_idle_fraction": s["generation_idle_fraction"],
                "reward_first_quarter": s["reward_first_quarter"], "reward_last_quarter": s["reward_last_quarter"],
                "staleness_mean": sum(r["staleness_mean"] for r in rows) / len(rows),
                "dropped_samples": s["dropped_samples"],
                "rewards": [r["reward_mean"] for r in rows],
            }
    finally:
        ray.shutdown()

    speedup = results["async"]["steps_per_hour"] / results["sync"]["steps_per_hour"]
    print(f"\nasync vs sync, {steps} steps each, max_staleness {args.max_staleness}, "
          f"{platform.processor() or platform.machine()}, quick={args.quick}")
    print(f"{'mode':<6} {'steps/h':>9} {'train idle':>11} {'gen idle':>9} {'stale':>6} {'reward first->last':>20}")
    for m, r in results.items():
        print(f"{m:<6} {r['steps_per_hour']:>9.0f} {r['trainer_idle_fraction']:>11.2f} "
              f"{r['generation_idle_fraction']:>9.2f} {r['staleness_mean']:>6.2f} "
              f"{r['reward_first_quarter']:>9.3f} -> {r['reward_last_quarter']:.3f}")
    print(f"speedup (async / sync steps per hour): {speedup:.2f}x")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "async_vs_sync_quick" if args.quick else "async_vs_sync"
    doc = {"command": "python -m app bench async_vs_sync" + (" --quick" if args.quick else ""),
           "steps": steps, "max_staleness": args.max_staleness, "max_new_tokens": args.max_new_tokens,
           "machine": f"{platform.machine()} {platform.processor()}", "speedup": speedup, "results": results}
    (out / f"{name}.json").write_text(json.dumps(doc, indent=2))
    _plot(results, speedup, out / f"{name}.png")
    print(f"wrote {out / (name + '.json')} and .png")
    return 0


def _plot(results: dict, speedup: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    modes = list(results)
    a.bar(modes, [results[m]["steps_per_hour"] for m in modes], color=["#999", "#2a7"])
    a.set_ylabel("optimizer steps per hour")
    a.set_title(f"throughput (async {speedup:.2f}x sync)")
    for m in modes:
        b.plot(range(1, len(results[m]["rewards"]) + 1), results[m]["rewards"], ".-", label=m)
    b.set_xlabel("step")
    b.set_ylabel("batch reward mean")
    b.set_title("reward per step")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
