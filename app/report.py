"""What a person looks at after a run: summary.json, the reward curve, and `python -m app report RUN_DIR`
(the panels of `report.png` and a one-screen summary of any run, finished, failed or still running)."""
from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(rows: list[dict], wall_seconds: float, extra: dict | None = None) -> dict:
    rewards = [r["reward_mean"] for r in rows if "reward_mean" in r]
    k = max(1, len(rewards) // 4)
    steps = len(rows)
    return {
        "steps": steps,
        "wall_seconds": wall_seconds,
        "steps_per_hour": 3600.0 * steps / wall_seconds if wall_seconds > 0 else None,
        "reward_first_quarter": _mean(rewards[:k]),
        "reward_last_quarter": _mean(rewards[-k:]),
        "final_version": max((r.get("version", 0) for r in rows), default=0),
        "dropped_samples": max((r.get("dropped_samples", 0) for r in rows), default=0),
        "staleness_max": max((r.get("staleness_max", 0) for r in rows), default=0),
        **(extra or {}),
    }


def plot_rewards(rows: list[dict], out: Path, title: str = "") -> Path | None:
    """Reward mean per step (with a min/max band over the step's groups when present) and a 5-step mean."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [(r["step"], r["reward_mean"], r.get("reward_std", 0.0)) for r in rows if "reward_mean" in r]
    if not pts:
        return None
    steps, mean, std = zip(*pts)
    smooth = [_mean(list(mean[max(0, i - 4):i + 1])) for i in range(len(mean))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, mean, ".", alpha=0.5, label="reward mean (batch)")
    ax.plot(steps, smooth, "-", lw=2, label="5-step mean")
    for key in _eval_keys(rows):
        ev = _eval_series(rows, key)
        ax.plot(*zip(*ev), "o-", ms=3, label=key)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("reward")
    ax.set_title(title or "GRPO reward")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def write_summary(run_dir: Path, summary: dict) -> Path:
    p = run_dir / "summary.json"
    p.write_text(json.dumps(summary, indent=2, default=float))
    return p


# ---------------------------------------------------------------- `python -m app report RUN_DIR`

def read_rows(path: Path) -> tuple[list[dict], int]:
    """metrics.jsonl as rows, tolerating a run that died mid-write: lines that do not parse (a truncated
    last line) or carry no step are skipped and counted."""
    rows, bad = [], 0
    if not path.is_file():
        return rows, bad
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), (int, float)):
            rows.append(row)
        else:
            bad += 1
    return rows, bad


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _series(rows: list[dict], key: str, at: str = "step") -> list[tuple[float, float]]:
    """(x, value) of `key` over the rows that have it, x the row's `at` (its step when it has none)."""
    return [(r.get(at, r["step"]), float(r[key])) for r in rows if _num(r.get(key))]


def _eval_series(rows: list[dict], key: str) -> list[tuple[float, float]]:
    """An eval score at the step whose policy it scored (eval/step): an eval runs beside training and lands in
    a later step's row, so the logging row's step would draw the curve late (on a GPU, by up to 30 steps)."""
    return _series(rows, key, at="eval/step")


# eval/* bookkeeping (which version, how many prompts, how long) is not a score to plot beside rewards.
_EVAL_BOOKKEEPING = {"eval/step", "eval/version", "eval/samples", "eval/seconds"}


def _eval_keys(rows: list[dict]) -> list[str]:
    """The eval scores in the rows (accuracy, pass@k, reward mean): numbers in [0, 1] like the reward."""
    return sorted({k for r in rows for k, v in r.items()
                   if k.startswith("eval/") and k not in _EVAL_BOOKKEEPING and _num(v)})


def trainer_idle(rows: list[dict]) -> list[tuple[float, float]]:
    """Per step: time waiting for a batch / step time."""
    return [(r["step"], r["batch_wait_seconds"] / r["step_seconds"]) for r in rows
            if _num(r.get("batch_wait_seconds")) and _num(r.get("step_seconds")) and r["step_seconds"] > 0]


def generation_idle(rows: list[dict], workers: int | None) -> list[tuple[float, float]]:
    """Per step: 1 - rollout-worker busy time / (workers x wall time since the previous row)."""
    if not workers:
        return []
    out = []
    for prev, r in zip(rows, rows[1:]):
        dt = r.get("time", 0) - prev.get("time", 0) if _num(r.get("time")) and _num(prev.get("time")) else 0
        if dt > 0 and _num(r.get("gen_seconds_sum")):
            out.append((r["step"], max(0.0, 1.0 - r["gen_seconds_sum"] / (workers * dt))))
    return out


def idle_fractions(rows: list[dict], workers: int) -> dict:
    """Over the run, for summary.json: trainer idle = time waiting for a batch / step time; generation
    idle = 1 - time the rollout workers spent generating / (workers x wall time). Both over steps 2..
    (step 1 waits for warm-up)."""
    steady = rows[1:] if len(rows) > 1 else rows
    if not steady:
        return {"trainer_idle_fraction": None, "generation_idle_fraction": None}
    wall = steady[-1]["time"] - rows[0]["time"] if len(rows) > 1 else steady[0].get("step_seconds", 0.0)
    gen_busy = sum(r.get("gen_seconds_sum", 0.0) for r in steady)
    return {
        "trainer_idle_fraction": sum(r.get("batch_wait_seconds", 0.0) for r in steady)
        / max(1e-9, sum(r.get("step_seconds", 0.0) for r in steady)),
        "generation_idle_fraction": max(0.0, 1.0 - gen_busy / max(1e-9, workers * wall)),
    }


def _panels(rows: list[dict], workers: int | None) -> list[tuple[str, str, list[tuple[str, list, str]]]]:
    """(title, y label, [(label, points, style)]) for every panel that has data."""
    def s(key, style="-"):
        return (key, _series(rows, key), style)

    reward = [s("reward_mean", ".-")] + [(k, _eval_series(rows, k), "o-") for k in _eval_keys(rows)]
    panels = [
        ("reward and eval", "reward / score", reward),
        ("KL and trainer/vLLM log ratio", "per token", [s("kl"), s("log_ratio_abs_mean")]),
        ("staleness and dropped samples", "versions / samples",
         [s("staleness_mean"), s("staleness_max", "--"),
          ("dropped_samples (run total)", _series(rows, "dropped_samples"), ":")]),
        ("sync latency", "seconds", [s("publish_seconds", ".-")]),
        ("throughput", "tokens / s", [s("train_tokens_per_s"), s("gen_tokens_per_s")]),
        ("idle fractions", "fraction of time",
         [("trainer idle (batch wait / step)", trainer_idle(rows), "-"),
          ("generation idle", generation_idle(rows, workers), "--")]),
    ]
    return [(t, y, [c for c in curves if c[1]]) for t, y, curves in panels if any(c[1] for c in curves)]


def plot_report(rows: list[dict], out: Path, title: str = "", workers: int | None = None) -> Path | None:
    """One PNG, one panel per group of metrics present in the rows (missing keys skip their panel)."""
    panels = _panels(rows, workers)
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 2 if len(panels) > 1 else 1
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(6.5 * cols, 3.2 * nrows), squeeze=False)
    for ax, (ptitle, ylabel, curves) in zip(axes.flat, panels):
        for label, pts, style in curves:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, style, ms=3, label=label)
        ax.set_title(ptitle, fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        if ptitle == "idle fractions":
            ax.set_ylim(0, 1.05)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _load_yaml(path: Path) -> dict:
    try:
        import yaml

        d = yaml.safe_load(path.read_text())
        return d if isinstance(d, dict) else {}
    except Exception:  # a report never fails on a damaged side file
        return {}


def _load_json(path: Path) -> dict | None:
    try:
        d = json.loads(path.read_text())
        return d if isinstance(d, dict) else None
    except Exception:
        return None


def _fmt(v, spec: str = ".3f") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return format(v, spec) if isinstance(v, (int, float)) else str(v)


def _stat(pts: list[tuple[float, float]], fn=statistics.median):
    return fn([v for _, v in pts]) if pts else None


def report_text(run_dir: Path, rows: list[dict], bad_lines: int, summary: dict | None, cfg: dict,
                pngs: list[Path]) -> str:
    """The one-screen summary."""
    total = (cfg.get("train") or {}).get("total_steps")
    steps = len(rows)
    last = int(rows[-1]["step"]) if rows else 0
    if summary is not None:
        state = "finished (summary.json)"
    elif not rows:
        state = "no steps logged (failed early, or starting)"
    else:
        mtime = (run_dir / "metrics.jsonl").stat().st_mtime
        age = time.time() - mtime
        state = ("not finished, probably still running" if age < 120 else "not finished: failed or killed") + \
            " (no summary.json; metrics.jsonl last written " \
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(mtime))}, " \
            f"{age:.0f} s ago)"
    run = cfg.get("run") or {}
    lines = [f"run: {run_dir}" + (f"  [{run.get('name')}, mode {run.get('mode')}]" if run else ""),
             f"state: {state}",
             f"steps: {steps}" + (f" (last step {last} of {total})" if total else f" (last step {last})")
             + (f"; {bad_lines} unreadable line(s) in metrics.jsonl skipped" if bad_lines else "")]
    if rows:
        times = [r["time"] for r in rows if _num(r.get("time"))]
        wall = (summary or {}).get("wall_seconds") or (
            times[-1] - times[0] + (rows[0].get("step_seconds") or 0.0) if times else None)
        if wall:
            lines.append(f"wall: {wall:.0f} s ({3600.0 * steps / wall:.0f} steps/hour)")
        rewards = [v for _, v in _series(rows, "reward_mean")]
        if rewards:
            k = max(1, len(rewards) // 4)
            lines.append(f"reward: {_fmt(sum(rewards[:k]) / k)} (first quarter) -> {_fmt(sum(rewards[-k:]) / k)} "
                         f"(last quarter); last {_fmt(rewards[-1])}, best {_fmt(max(rewards))}")
        for key in _eval_keys(rows):
            ev = _eval_series(rows, key)
            lines.append(f"{key}: {_fmt(ev[0][1])} (step {ev[0][0]}) -> {_fmt(ev[-1][1])} (step {ev[-1][0]})")
        kl, lr = _series(rows, "kl"), _series(rows, "log_ratio_abs_mean")
        if kl or lr:
            lines.append(f"kl last {_fmt(kl[-1][1] if kl else None, '.4g')}; |log ratio| trainer/vLLM median "
                         f"{_fmt(_stat(lr), '.4g')}, max {_fmt(_stat(lr, max), '.4g')}")
        st = _series(rows, "staleness_mean")
        if st or _series(rows, "dropped_samples"):
            lines.append(f"staleness mean {_fmt(_stat(st, statistics.mean), '.2f')}, max "
                         f"{_fmt(_stat(_series(rows, 'staleness_max'), max), 'g')}; dropped samples "
                         f"{_fmt(_stat(_series(rows, 'dropped_samples'), max), 'g')}")
        pub = _series(rows, "publish_seconds")
        if pub:
            lines.append(
                f"sync latency (publish): median {1e3 * _stat(pub):.0f} ms, max {1e3 * _stat(pub, max):.0f} ms"
            )
        tt, gt = _series(rows, "train_tokens_per_s"), _series(rows, "gen_tokens_per_s")
        if tt or gt:
            lines.append(f"throughput: trainer {_fmt(_stat(tt), '.0f')} tokens/s, generation "
                         f"{_fmt(_stat(gt), '.0f')} tokens/s (medians)")
        workers = (cfg.get("rollout") or {}).get("workers")
        ti, gi = trainer_idle(rows[1:]), generation_idle(rows, workers)
        if ti or gi:
            lines.append(f"idle: trainer {_fmt(_stat(ti, statistics.mean), '.0%')}, generation "
                         f"{_fmt(_stat(gi, statistics.mean), '.0%')} (means over steps 2..)")
    if summary and summary.get("adapter_dir"):
        lines.append(f"adapter: {summary['adapter_dir']}")
    lines.append("plots: " + (", ".join(str(p) for p in pngs) if pngs else "none (no metrics to plot)"))
    return "\n".join(lines)


def report(run_dir: str | Path, plots: bool = True) -> str:
    """Regenerate the plots of RUN_DIR from what it holds and return the one-screen summary. Raises
    FileNotFoundError when RUN_DIR is not a directory."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run directory")
    rows, bad = read_rows(run_dir / "metrics.jsonl")
    rows.sort(key=lambda r: r["step"])
    cfg = _load_yaml(run_dir / "config.yaml") if (run_dir / "config.yaml").is_file() else {}
    summary = _load_json(run_dir / "summary.json") if (run_dir / "summary.json").is_file() else None
    pngs: list[Path] = []
    if plots and rows:
        run = cfg.get("run") or {}
        title = f"{run.get('name', run_dir.name)} ({run.get('mode', '?')})"
        workers = (cfg.get("rollout") or {}).get("workers")
        pngs = [p for p in (plot_rewards(rows, run_dir / "reward_curve.png", title=title),
                            plot_report(rows, run_dir / "report.png", title=title, workers=workers)) if p]
    return report_text(run_dir, rows, bad, summary, cfg, pngs)
