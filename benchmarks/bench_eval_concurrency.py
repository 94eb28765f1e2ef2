"""How long a held-out evaluation takes while the run trains, by eval.concurrency: the main job
(recipes/tiny-cpu.yaml, `python -m app train` as a user runs it) once per setting, its evals' seconds
and its steps read back from metrics.jsonl. While a run trains the engines' queues are full of
rollouts, and each wave of eval requests waits about one rollout turn: the fewer in flight, the more
waves and the later an eval's result lands (8 at a time took 55-64 s for 128 prompts on one GPU).

    python -m app bench eval_concurrency                       # eval.concurrency 8 against the default
    python -m app bench eval_concurrency --settings 8,32,default

Prints a table and writes benchmarks/results/eval_concurrency.json and .png.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common.stats import p50

REPO = Path(__file__).resolve().parents[1]
RECIPE = "recipes/tiny-cpu.yaml"


def summarize(rows: list[dict]) -> dict:
    """The evals' seconds (those beside training: not the one before step 1, when the engines are idle), how
    many steps after its own each eval landed, and the run's step time and reward."""
    evals = [r for r in rows if "eval/seconds" in r]
    during = [r for r in evals if r.get("eval/step", 0) > 0 and r.get("eval/step") != rows[-1]["step"]]
    steps = [r["step_seconds"] for r in rows if "step_seconds" in r][2:]
    rewards = [r["reward_mean"] for r in rows if "reward_mean" in r]
    k = max(1, len(rewards) // 4)
    return {
        "evals": len(evals),
        "eval_seconds_during_training_p50": p50([r["eval/seconds"] for r in during]),
        "eval_seconds_during_training_max": max((r["eval/seconds"] for r in during), default=None),
        "eval_seconds_before_step_1": next((r["eval/seconds"] for r in evals if r.get("eval/step") == 0), None),
        "eval_lag_steps_p50": p50([r["step"] - r["eval/step"] for r in during]),
        "step_seconds_mean": sum(steps) / len(steps) if steps else None,
        "reward_first_quarter": sum(rewards[:k]) / k if rewards else None,
        "reward_last_quarter": sum(rewards[-k:]) / k if rewards else None,
        "final_eval_accuracy": evals[-1].get("eval/accuracy") if evals else None,
    }


def _run(setting: str, work: Path, extra: list[str], index: int) -> dict:
    name = f"eval-{index}-c{setting}"  # a setting may come twice (interleaved repeats: these machines are noisy)
    sets = [f"run.out_dir={work}", f"run.name={name}", *extra]
    if setting != "default":
        sets.append(f"eval.concurrency={setting}")
    cmd = [sys.executable, "-m", "app", "train", "--config", RECIPE, *[a for s in sets for a in ("--set", s)]]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd)} exited {proc.returncode}:\n"
                         f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines() if line.strip()]
    from app.evaluate import eval_concurrency
    from common import config as C

    conc = eval_concurrency(C.load(str(REPO / RECIPE), sets))  # what the run used ("default" resolved)
    return {"setting": setting, "eval_concurrency": conc, "wall_seconds": wall, **summarize(rows)}


def _plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = doc["runs"]
    x = list(range(len(runs)))  # one bar a run: a setting repeated keeps each of its runs
    labels = [f"{r['setting']} ({r['eval_concurrency']})\nrun {i}" for i, r in enumerate(runs, 1)]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    axes[0].bar(x, [r["eval_seconds_during_training_p50"] or 0 for r in runs], color="tab:green")
    axes[0].set_title("eval seconds beside training (p50)")
    axes[1].bar(x, [r["step_seconds_mean"] or 0 for r in runs], color="tab:blue")
    axes[1].set_title("step seconds (mean)")
    for ax in axes:
        ax.set_xticks(x, labels)
        ax.set_xlabel("eval.concurrency")
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"{RECIPE}, {doc['eval_samples']} eval prompts")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default="8,default", help="eval.concurrency values, comma-separated ('default': "
                                                           "the config's own, a quarter of the replicas' slots)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config overrides")
    args = p.parse_args(argv)
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    bad = [s for s in settings if s != "default" and not (s.isdigit() and int(s) >= 1)]
    if bad:
        p.error(f"--settings: {bad} are neither 'default' nor a count >= 1")
    from common import config as C

    samples = C.load(str(REPO / RECIPE), args.set).eval.samples
    runs = []
    with tempfile.TemporaryDirectory(prefix="eval-conc-") as tmp:
        for i, s in enumerate(settings, 1):
            print(f"[{i}/{len(settings)}] {RECIPE} with eval.concurrency {s} ...", flush=True)
            runs.append(_run(s, Path(tmp), args.set, i))
    doc = {"benchmark": "eval_concurrency", "recipe": RECIPE, "eval_samples": samples, "runs": runs,
           "machine": f"{platform.machine()}, {os.cpu_count()} cores",
           "command": "python -m app bench eval_concurrency " + " ".join(argv if argv is not None else sys.argv[1:])}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval_concurrency.json").write_text(json.dumps(doc, indent=1) + "\n")
    _plot(doc, out / "eval_concurrency.png")
    print(f"{'eval.concurrency':>17} {'eval s (p50)':>12} {'lag steps':>9} {'step s':>7} {'wall s':>7} "
          f"{'final acc':>9}")
    for r in runs:
        f = lambda v, fmt: format(v, fmt) if v is not None else "-"  # noqa: E731
        print(f"{r['setting'] + ' (' + str(r['eval_concurrency']) + ')':>17} "
              f"{f(r['eval_seconds_during_training_p50'], '.2f'):>12} {f(r['eval_lag_steps_p50'], 'd'):>9} "
              f"{f(r['step_seconds_mean'], '.2f'):>7} {r['wall_seconds']:>7.0f} "
              f"{f(r['final_eval_accuracy'], '.3f'):>9}")
    print(f"wrote {out / 'eval_concurrency.json'} and .png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
