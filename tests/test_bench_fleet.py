"""Smoke test of `python -m app bench fleet --quick`: K = 2 tiny runs on one shared fleet and
the same runs one after another with services of their own, as a subprocess (its own Ray cluster, Serve, vLLM
and DeepSpeed). Asserts the JSON's shape and that every run of both modes finished its steps; no timing or
learning asserts (4 steps measure nothing). And, without Ray, how two calls' results (--modes, --merge-into,
--seq-from: the GPU benchmark in pieces) combine, and the one-GPU fractions."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import bench_fleet as bf  # noqa: E402


@pytest.mark.slow
@pytest.mark.bench  # minutes: four runs and a fleet; test_fleet covers runs sharing a fleet
def test_bench_fleet_quick(tmp_path):
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "app", "bench", "fleet", "--quick", "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"bench fleet exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-3000:]}"
    doc = json.loads((tmp_path / "fleet_quick.json").read_text())
    assert (tmp_path / "fleet_quick.png").is_file()
    assert doc["quick"] is True and doc["ks"] == [2]
    assert doc["recipe"] == "recipes/tiny-cpu.yaml" and doc["gpu_fraction"] is None and doc["modes"] == list(bf.MODES)
    assert [r["name"] for r in doc["results"]["sequential_runs"]] == ["seq-r0", "seq-r1"]
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


def _run(name: str, seed: int, wall: float, z: float = 4.0) -> dict:
    return {"name": name, "seed": seed, "wall_s": wall, "finished": True, "reward_z": z, "rewards": [0.2, 0.4],
            "publish_to_served_s": [0.1]}


def test_merge_three_calls():
    """shared K=2,4 in one call, sequential runs 0-1 in a second, 2-3 in a third: ratios at both K."""
    shares = {"max_rel_dev_all_attached": 0.05, "max_rel_dev_last_seen": 0.1}
    shared = {"shared": {k: {"wall_s": 100.0 * k, "shares": shares, "runs": [_run(f"k{k}-r{i}", i, 100.0 * k)
                                                                          for i in range(k)]} for k in (2, 4)},
              "sequential_runs": [], "fleet_start_s": 40.0}
    first = json.loads(json.dumps({"results": shared}))["results"]  # as read back: K keys are strings
    first["shared"] = {int(k): v for k, v in first["shared"].items()}
    seq01 = {"shared": {}, "sequential_runs": [_run("seq-r0", 0, 150.0), _run("seq-r1", 1, 170.0)]}
    two = bf.with_sequential(bf.merge_results(first, seq01, ["sequential"]), [2, 4])
    assert two["fleet_start_s"] == 40.0 and two["sequential"][2]["wall_s"] == 320.0 and 4 not in two["sequential"]
    seq23 = {"shared": {}, "sequential_runs": [_run("seq-r3", 3, 160.0), _run("seq-r2", 2, 150.0, z=1.0)]}
    three = bf.with_sequential(bf.merge_results(two, seq23, ["sequential"]), [2, 4])
    assert [r["seed"] for r in three["sequential_runs"]] == [0, 1, 2, 3]
    per_k = bf.analyse(three, [2, 4])
    assert per_k["per_k"][2]["wall_ratio_shared_over_sequential"] == pytest.approx(200 / 320, abs=1e-3)
    assert per_k["per_k"][4]["wall_ratio_shared_over_sequential"] == pytest.approx(400 / 630, abs=1e-3)
    assert per_k["targets_met"] == {"wall_ratio_le_0.7_at_k2": True, "every_z_gt_3": False,  # seq-r2's z is 1
                                    "shares_within_15pct": True}
    assert bf.setup_mismatch({"steps": 60, "gpu_fraction": 0.2}, {"steps": 60, "gpu_fraction": 0.3}) == [
        "gpu_fraction: 0.2 in the merged file, 0.3 here"]


def test_one_gpu_fractions():
    """K trainers and the replicas fit one GPU, in multiples of 0.05."""
    assert [bf.gpu_fraction(k, 1) for k in (1, 2, 4, 8)] == [0.5, 0.3, 0.2, 0.1]
    for k in range(1, 19):
        f = bf.gpu_fraction(k, 1)
        assert f * (k + 1) <= 1 + 1e-9 and (f + 0.05) * (k + 1) > 1
