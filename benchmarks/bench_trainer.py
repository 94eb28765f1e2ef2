"""Trainer benchmark: step time and adapter publish latency under Ray Train, 1 and 2 workers, tiny model,
synthetic batches, publishing every step into a real AdapterRegistry actor.

    python -m benchmarks.bench_trainer            # 12 steps per configuration
    python -m benchmarks.bench_trainer --quick    # 4 steps, for a smoke check

Prints a table and writes benchmarks/results/trainer.json. Step 1 (warm-up) is left out of the stats."""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def run_one(ray, model: Path, workdir: Path, workers: int, zero: int, steps: int, args) -> dict:
    from app.metrics import METRICS_NAME, RunMetrics
    from common.config import from_dict, validate
    from common.registry import NAMESPACE, REGISTRY_NAME, AdapterRegistry
    from train_loops.harness import HarnessOptions, build_trainer

    name = f"w{workers}-z{zero}"
    registry = AdapterRegistry.options(name=REGISTRY_NAME, namespace=NAMESPACE).remote(keep=3)
    metrics = RunMetrics.options(name=METRICS_NAME, namespace=NAMESPACE).remote(str(workdir / name))
    cfg = from_dict({
        "model": {"path": str(model), "build_tiny": False, "dtype": "float32"},
        "lora": {"rank": args.rank, "alpha": 2.0 * args.rank, "target_modules": "all-linear"},
        "grpo": {"group_size": args.group_size, "prompts_per_step": args.prompts,
                 "max_new_tokens": args.max_new_tokens},
        "train": {"num_workers": workers, "cpus_per_worker": 0.5, "zero_stage": zero, "total_steps": steps,
                  "logprob_chunk": 4096},
        "checkpoint": {"every": 0, "keep": 1},
        "run": {"name": name},
        "rollout": {"max_lora_rank": 8 if args.rank <= 8 else 64},
    })
    validate(cfg)
    t0 = time.perf_counter()
    result = build_trainer(cfg, workdir, HarnessOptions(runner="ray")).fit()
    wall = time.perf_counter() - t0
    if result.error is not None:
        raise RuntimeError(f"{name} failed: {result.error}")
    rows = ray.get(metrics.get_rows.remote())[1:]
    ray.kill(registry)
    ray.kill(metrics)
    step_s = [r["step_seconds"] for r in rows]
    learn_s = [r["learn_seconds"] for r in rows]
    pub_s = [r["publish_seconds"] for r in rows if r.get("published")]
    return {
        "workers": workers, "zero_stage": zero, "steps_timed": len(rows),
        "samples_per_step": args.prompts * args.group_size,
        "step_s_p50": statistics.median(step_s), "step_s_mean": statistics.fmean(step_s),
        "learn_s_p50": statistics.median(learn_s),
        "train_tokens_per_s_p50": statistics.median(r["train_tokens_per_s"] for r in rows),
        "publish_s_p50": statistics.median(pub_s), "publish_s_p95": pct(pub_s, 0.95),
        "adapter_bytes": rows[-1]["adapter_bytes"], "fit_wall_s": wall,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 steps per configuration")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--zero-stage", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="results directory")
    args = ap.parse_args(argv)
    steps = 4 if args.quick else args.steps

    import ray

    from app.tiny_model import build_tiny_model

    results = []
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        tmp = Path(tmp)
        model = build_tiny_model(tmp / "tiny")
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            for w in args.workers:
                results.append(run_one(ray, model, tmp, w, args.zero_stage, steps, args))
        finally:
            ray.shutdown()

    hdr = ["workers", "zero", "step p50 s", "learn p50 s", "tok/s p50", "publish p50 ms", "publish p95 ms",
           "adapter KB"]
    print(" | ".join(f"{h:>14}" for h in hdr))
    for r in results:
        vals = [r["workers"], r["zero_stage"], f"{r['step_s_p50']:.3f}", f"{r['learn_s_p50']:.3f}",
                f"{r['train_tokens_per_s_p50']:.0f}", f"{1e3 * r['publish_s_p50']:.1f}",
                f"{1e3 * r['publish_s_p95']:.1f}", f"{r['adapter_bytes'] / 1024:.0f}"]
        print(" | ".join(f"{v:>14}" for v in vals))
    out = Path(args.out) / ("trainer_quick.json" if args.quick else "trainer.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "trainer", "quick": args.quick, "steps": steps, "time": time.time(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "model": "tiny Qwen2 (hidden 128, 2 layers, char vocab)", "batch_source": "synthetic",
        "settings": {k: v for k, v in vars(args).items() if k != "out"}, "results": results,
    }, indent=2))
    _plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and .png")
    return 0


def _plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [f"{r['workers']} worker(s)" for r in results]
    a.bar(names, [r["step_s_p50"] for r in results])
    a.set_ylabel("step p50 (s)")
    b.bar(names, [1e3 * r["publish_s_p50"] for r in results], label="p50")
    b.bar(names, [1e3 * (r["publish_s_p95"] - r["publish_s_p50"]) for r in results],
          bottom=[1e3 * r["publish_s_p50"] for r in results], alpha=0.4, label="to p95")
    b.set_ylabel("adapter publish (ms)")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
