"""Long-tailed completion lengths: sync vs async vs async + partial rollouts on the same work (issue 42).

The tiny recipe's letters task, but every prompt carries its own completion length drawn from a
long-tailed distribution (benchmarks/length_tail.py; `grpo.ignore_eos` makes each completion exactly
that long). A few long completions hold a synchronous step back; async runs ahead but drops what the
trainer has left behind (`sync.max_staleness`); partial rollouts continue those under the newer version
instead (`rollout.partial`). Real Ray, Serve, vLLM and DeepSpeed, local cluster.

    python -m app bench length_tail                   # 30 steps each, lengths 24:1.0:256, max_staleness 1
    python -m app bench length_tail --quick           # 3 steps each, one replica (smoke)
    python -m app bench length_tail --from-gpu DIR --tag h100_2026-12-06   # record a GPU lease's runs

Prints a table and writes benchmarks/results/length_tail_cpu.json and .png. On one GPU the reference shape
runs the same comparison: `gpu_pipeline.py --phases pipeline --modes sync,async,async-partial
--length-tail 400:1.0:3000` (docs/GPU.md); `--from-gpu DIR` turns what its runs brought back into DIR
(gpu_pipeline_length_tail.json, gpu_pipeline_tail-MODE.metrics.jsonl) into the same table, record and plot,
length_tail_gpu_TAG.json and .png.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

from common.stats import mean

REPO = Path(__file__).resolve().parents[1]
MODES = {"sync": ["run.mode=sync"], "async": ["run.mode=async"],
         "async-partial": ["run.mode=async", "rollout.partial=true"]}
QUICK = ["rollout.replicas=1", "train.num_workers=1", "rollout.workers=1", "grpo.prompts_per_step=8"]


def main(argv=None) -> int:
    from benchmarks.length_tail import COLUMN, describe, draw_lengths, parse_spec, with_lengths, write_jsonl

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--length-tail", default="24:1.0:256", help="MEDIAN:SIGMA:MAX[:MIN] of the completion lengths")
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--modes", default=",".join(MODES), help=f"which runs, of {', '.join(MODES)}")
    p.add_argument("--quick", action="store_true", help="3 steps each on one replica and one train worker")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config overrides")
    p.add_argument("--from-gpu", metavar="DIR", help="record gpu_pipeline's length-tailed runs brought back into DIR")
    p.add_argument("--tag", default="gpu", help="with --from-gpu: the record's name, length_tail_gpu_TAG")
    args = p.parse_args(argv)
    if args.from_gpu:
        return _from_gpu(Path(args.from_gpu), Path(args.out), args.tag, argv)
    tail = parse_spec(args.length_tail)
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"--modes: unknown {unknown} (known: {', '.join(MODES)})")
    steps = 3 if args.quick else args.steps

    import ray

    from app import driver
    from app.data import letters_task
    from app.tiny_model import ensure_model
    from common import config as C

    work = Path(tempfile.mkdtemp(prefix="bench-tail-"))
    rows = letters_task(512, seed=0)
    lengths = draw_lengths(len(rows), tail["median"], tail["sigma"], tail["hi"], tail["lo"], seed=0)
    data = write_jsonl(work / "letters-tailed.jsonl", with_lengths(rows, lengths))
    model = ensure_model(REPO / "runs" / "tiny-model")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false",
                                       "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "600"}})
    results = {}
    try:
        for mode in modes:
            cfg = C.load(str(REPO / "recipes" / "tiny-cpu.yaml"), [
                f"model.path={model}", "model.build_tiny=false", f"model.max_model_len={tail['hi'] + 64}",
                f"data.path={data}", "data.id_column=id", f"data.max_tokens_column={COLUMN}",
                f"grpo.max_new_tokens={tail['hi']}", "grpo.ignore_eos=true", "eval.path=null",
                f"run.out_dir={work}", f"run.name={mode}", f"train.total_steps={steps}", "checkpoint.every=0",
                f"sync.max_staleness={args.max_staleness}", *MODES[mode], *(QUICK if args.quick else []),
                *args.set])
            t0 = time.time()
            s = driver.run(cfg, progress=True)
            metrics = [json.loads(x) for x in (work / mode / "metrics.jsonl").read_text().splitlines() if x.strip()]
            results[mode] = _record(metrics, s, time.time() - t0)
    finally:
        ray.shutdown()

    _print_table(results, f"length-tailed completions {args.length_tail} (MEDIAN:SIGMA:MAX), {steps} steps each, "
                          f"max_staleness {args.max_staleness}, {platform.processor() or platform.machine()}")
    ratios = _ratios(results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "length_tail_quick" if args.quick else "length_tail_cpu"
    command = "python -m app bench length_tail" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    doc = {"command": command, "quick": args.quick, "steps": steps, "length_tail": tail,
           "lengths": describe(lengths, tail["hi"]), "max_staleness": args.max_staleness,
           "machine": f"{platform.machine()} {platform.processor()}",
           "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **ratios, "results": results}
    (out / f"{name}.json").write_text(json.dumps(doc, indent=2))
    _plot(doc, lengths, out / f"{name}.png")
    print(f"wrote {out / (name + '.json')} and .png")
    return 0


def _print_table(results: dict, title: str) -> None:
    print(f"\n{title}")
    print(f"{'mode':<14} {'step s':>7} {'p50 s':>6} {'tok/step':>9} {'dropped':>8} {'expired':>8} {'resumed':>8} "
          f"{'regen tok':>9} {'train idle':>10} {'reward first->last':>19}")
    for m, r in results.items():
        print(f"{m:<14} {r['step_seconds_mean']:>7.2f} {r['step_seconds_p50']:>6.2f} "
              f"{r['completion_tokens_per_step']:>9.0f} {r['dropped_samples']:>8} "
              f"{r['expired_groups']:>8} "
              f"{r['partial_resumed']:>8} {r['tokens_regenerated']:>9} {_num(r['trainer_idle_fraction']):>10} "
              f"{_num(r['reward_first_quarter'], 3):>8} -> {_num(r['reward_last_quarter'], 3)}")


def _num(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"  # a run stopped at its deadline has no summary


def _ratios(results: dict) -> dict:
    """Async + partial over each other mode: steps per hour, and completion tokens trained per second (a mode that
    aborts long completions does less work per step)."""
    step_s = {m: r["step_seconds_mean"] for m, r in results.items()}
    ratios = {f"partial_vs_{m}": step_s[m] / step_s["async-partial"] for m in ("async", "sync")
              if m in step_s and "async-partial" in step_s}
    tok_s = {m: r.get("completion_tokens_per_s") for m, r in results.items()}
    ratios.update({f"partial_vs_{m}_tokens": tok_s["async-partial"] / tok_s[m] for m in ("async", "sync")
                   if tok_s.get(m) and tok_s.get("async-partial")})
    for k, v in ratios.items():
        print(f"{k} ({'completion tokens trained per second' if k.endswith('_tokens') else 'steps per hour'}): "
              f"{v:.2f}x")
    return ratios


def _from_gpu(src: Path, out: Path, tag: str, argv) -> int:
    """gpu_pipeline's length-tailed runs (one lease's files) as this benchmark's record: the same table, ratios
    and plot, with the GPU document's own numbers (its step mean skips two warm-up steps) kept beside."""
    from benchmarks.length_tail import describe, draw_lengths, parse_spec

    doc = json.loads((src / "gpu_pipeline_length_tail.json").read_text())
    tail = parse_spec(doc["length_tail"])
    results, gpu_runs = {}, {}
    for key, run in doc["runs"]["1gpu"].items():
        rows_file = src / f"gpu_pipeline_tail-{key}.metrics.jsonl"
        if not rows_file.exists():
            raise SystemExit(f"--from-gpu: {rows_file} is missing (the run {key!r} is in the document)")
        metrics = [json.loads(x) for x in rows_file.read_text().splitlines() if x.strip()]
        mode = key.removesuffix("-mps")
        results[mode] = _record(metrics, run, run.get("wall_seconds", 0.0))
        gpu_runs[mode] = {k: run.get(k) for k in ("step_seconds_mean", "step_seconds_p50", "dropped_samples",
                                                  "dropped_continued_groups", "dropped_waited_groups",
                                                  "expired_groups", "partial_resumed", "tokens_regenerated",
                                                  "served_wait_seconds_mean", "gpu_sm_util_mean", "stopped_at_deadline",
                                                  "wall_seconds")}
    lengths = draw_lengths(512, tail["median"], tail["sigma"], tail["hi"], tail["lo"], seed=0)  # gpu_pipeline's
    _print_table(results, f"length-tailed completions {doc['length_tail']}, {doc['device']}")
    record = {"command": "python -m app bench length_tail" + "".join(f" {a}" for a in (argv or sys.argv[1:])),
              "gpu_commands": doc.get("command"), "device": doc["device"], "versions": doc.get("versions"),
              "workload": doc.get("workload"), "measured_at": doc.get("measured_at"), "length_tail": tail,
              "lengths": describe(lengths, tail["hi"]),
              "max_staleness": (doc.get("workload") or {}).get("max_staleness"),
              **_ratios(results), "results": results, "gpu_pipeline_runs": gpu_runs}
    out.mkdir(parents=True, exist_ok=True)
    name = f"length_tail_gpu_{tag}"
    (out / f"{name}.json").write_text(json.dumps(record, indent=2))
    _plot(record, lengths, out / f"{name}.png")
    print(f"wrote {out / (name + '.json')} and .png")
    return 0


def _record(metrics: list[dict], s: dict, total_s: float) -> dict:
    steady = metrics[1:] or metrics  # step 1 waits for the engines' and the trainer's warm-up in every mode
    secs = sorted(r["step_seconds"] for r in steady)
    # A mode that aborts or drops long completions trains on fewer tokens per step: the same step time is then
    # less work, so the completion tokens trained per step and per second are beside the step time.
    tokens = sum(r.get("tokens", 0) for r in steady)
    return {"steps": len(metrics), "total_seconds": total_s,
            "step_seconds_mean": sum(secs) / len(secs), "step_seconds_p50": secs[len(secs) // 2],
            "completion_tokens_per_step": tokens / len(steady), "completion_tokens_per_s": tokens / sum(secs),
            "dropped_samples": max(r.get("dropped_samples", 0) for r in metrics),  # a run total on each row
            # of them, groups dropped after a sample of theirs had moved on (rollout.partial)
            "dropped_continued_groups": s.get("dropped_continued_groups",
                                              (s.get("buffer") or {}).get("dropped_continued_groups")),
            # of them, groups passed over by a batch while acceptable (the rest finished after their last batch)
            "dropped_waited_groups": s.get("dropped_waited_groups",
                                           (s.get("buffer") or {}).get("dropped_waited_groups")),
            # groups whose version left the window mid-generation: aborted, their prompts handed out again
            "expired_groups": max(r.get("rollout_expired_groups", 0) for r in metrics),
            "partial_resumed": sum(r.get("partial_resumed", 0) for r in metrics),
            "tokens_regenerated": sum(r.get("tokens_regenerated", 0) for r in metrics),
            # rollout.partial: the trainer waiting, at each batch, for the version it just published to be served
            "served_wait_seconds_mean": mean(r.get("served_wait_seconds") for r in steady),
            "versions_per_sample_mean": sum(r.get("versions_per_sample_mean", 1.0) for r in metrics) / len(metrics),
            "staleness_max": max(r.get("staleness_max", 0) for r in metrics),
            "trainer_idle_fraction": s.get("trainer_idle_fraction"),
            "generation_idle_fraction": s.get("generation_idle_fraction"),
            "reward_first_quarter": s["reward_first_quarter"], "reward_last_quarter": s["reward_last_quarter"],
            "step_seconds": [r["step_seconds"] for r in metrics], "rewards": [r["reward_mean"] for r in metrics]}


def _plot(doc: dict, lengths: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = doc["results"]
    modes = list(res)
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(14, 4))
    a.hist(lengths, bins=40, color="#68a")
    a.set_yscale("log")
    a.set_xlabel("completion length (tokens)")
    a.set_ylabel("prompts")
    a.set_title(f"lengths {doc['length_tail']['median']:g}:{doc['length_tail']['sigma']:g}:{doc['length_tail']['hi']}")
    colors = {"sync": "#999", "async": "#e93", "async-partial": "#2a7"}
    a_bars = b.bar(modes, [res[m]["step_seconds_mean"] for m in modes], color=[colors.get(m, "#555") for m in modes])
    for bar, m in zip(a_bars, modes):
        b.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"dropped {res[m]['dropped_samples']}",
               ha="center", va="bottom", fontsize=8)
    b.set_ylabel("mean step seconds (steps 2..N)")
    b.set_title("step time, dropped samples")
    for m in modes:
        c.plot(range(1, len(res[m]["step_seconds"]) + 1), res[m]["step_seconds"], ".-", label=m,
               color=colors.get(m))
    c.set_xlabel("step")
    c.set_ylabel("step seconds")
    c.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
