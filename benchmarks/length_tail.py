"""Long-tailed completion lengths for the length-tailed benchmarks (issue 42): most completions short, a
few up to the cap, as real reasoning lengths are. Each data row carries its own budget in the
`max_new_tokens` column (`data.max_tokens_column`), and `grpo.ignore_eos` makes every completion exactly
that long, so two runs see the same lengths whatever the policy learns.

A length is drawn from a log-normal (median, sigma) and clipped to [lo, hi]; the draw is seeded, and
`describe` records what was drawn (percentiles, the share at the cap) beside the results.
"""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

COLUMN = "max_new_tokens"


def parse_spec(spec: str) -> dict:
    """`MEDIAN:SIGMA:MAX[:MIN]` -> {median, sigma, hi, lo}; ValueError naming the problem."""
    parts = spec.split(":")
    if len(parts) not in (3, 4):
        raise ValueError(f"--length-tail {spec!r}: expected MEDIAN:SIGMA:MAX[:MIN], e.g. 400:1.0:3000")
    try:
        median, sigma, hi = float(parts[0]), float(parts[1]), int(parts[2])
        lo = int(parts[3]) if len(parts) == 4 else 1
    except ValueError:
        raise ValueError(f"--length-tail {spec!r}: MEDIAN and SIGMA are numbers, MAX and MIN integers") from None
    if not (1 <= lo <= median <= hi) or sigma <= 0:
        raise ValueError(f"--length-tail {spec!r}: needs 1 <= MIN <= MEDIAN <= MAX and SIGMA > 0")
    return {"median": median, "sigma": sigma, "hi": hi, "lo": lo}


def draw_lengths(n: int, median: float, sigma: float, hi: int, lo: int = 1, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


def with_lengths(rows: list[dict], lengths: list[int]) -> list[dict]:
    """Each row with its own budget; the rows cycle through the lengths (one length per prompt)."""
    return [dict(row, **{COLUMN: lengths[i % len(lengths)]}) for i, row in enumerate(rows)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def describe(lengths: list[int], hi: int) -> dict:
    xs = sorted(lengths)

    def pct(q: float) -> int:
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    return {"n": len(xs), "mean": sum(xs) / len(xs), "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99),
            "max": xs[-1], "at_cap_fraction": sum(x >= hi for x in xs) / len(xs),
            "tokens_in_top_decile_fraction": sum(xs[int(0.9 * len(xs)):]) / sum(xs)}
