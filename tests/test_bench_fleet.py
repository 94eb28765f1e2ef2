"""Smoke test of `python -m app bench fleet --quick` (issue 19): K = 2 tiny runs on one shared fleet and
the same runs one after another with services of their own, as a subprocess (its own Ray cluster, Serve, vLLM
and DeepSpeed). Asserts the JSON's shape and that every run of both modes finished its steps; no timing or
learning asserts (4 steps measure nothing)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_bench_fleet_quick(tmp_path):
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "app", "bench", "fleet", "--quick", "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"bench fleet exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-3000:]}"
    doc = json.loads((tmp_path / "fleet_quick.json").read_text())
    assert (tmp_path / "fleet_quick.png").is_file()
    assert doc["quick"] is True and doc["ks"] == [2]
    assert doc["fleet_start_s"] > 0 and "fleet_error" not in doc["results"]
    assert {"wall_ratio_le_0.7_at_k2", "every_z_gt_3", "shares_within_15pct"} == set(doc["targets_met"])
    steps = doc["steps"]
    for k in ("2",):
        row = doc["per_k"][k]
        assert row["shared_all_finished"] and row["sequential_all_finished"], row
        assert row["shared_wall_s"] > 0 and row["sequential_wall_s"] > 0
        assert row["wall_ratio_shared_over_sequential"] > 0
        for mode in ("shared", "sequential"):
            assert len(row[f"{mode}_z"]) == int(k)
            assert {"p50", "p95"} <= set(row[f"{mode}_publish_to_served_s"])
            runs = doc["results"][mode][k]["runs"]
            assert len({r["name"] for r in runs}) == int(k)
            for r in runs:
                assert r["finished"] and r["steps"] == steps and len(r["rewards"]) == steps, r.get("log_tail")
                assert r["publish_to_served_s"], f"{mode} K={k} {r['name']}: no publish_to_served_seconds in its rows"
        shares = doc["results"]["shared"][k]["shares"]
        assert shares["fair"] == pytest.approx(1 / int(k), abs=1e-3)
        assert set(shares["tokens_last_seen"]) == {r["name"] for r in doc["results"]["shared"][k]["runs"]}
        assert all(t and t > 0 for t in shares["tokens_last_seen"].values()), shares  # every run has a token share
        assert shares["share_last_seen"] and sum(shares["share_last_seen"].values()) == pytest.approx(1, abs=1e-2)
        assert row["share_max_rel_dev"] is not None
