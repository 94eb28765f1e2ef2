"""What a person looks at after a run: summary.json and the reward curve."""
from __future__ import annotations

import json
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
