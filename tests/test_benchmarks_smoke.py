"""Smoke test of the benchmarks: each one's --quick mode runs as a subprocess (its own Ray / vLLM),
exits 0 and writes its JSON with the expected keys into a tmp dir. No timing asserts. Those marked `bench`
take minutes and run paths other tests cover; the default run leaves them out (pyproject's addopts):
`pytest -m bench` runs them.

One test function per benchmark; add yours below."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def run_quick(name: str, out: Path, timeout: float = 300) -> dict:
    """`python -m app bench NAME --quick --out OUT`; returns the JSON it wrote (NAME_quick.json)."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "app", "bench", name, "--quick", "--out", str(out)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"bench {name} --quick exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    path = out / f"{name}_quick.json"
    assert path.is_file(), f"bench {name} --quick wrote no {path.name}; files: {sorted(p.name for p in out.iterdir())}"
    assert (out / f"{name}_quick.png").is_file()
    return json.loads(path.read_text())


@pytest.mark.bench  # publish -> load on every replica, both transports: test_router_serve, test_replica
def test_bench_adapter_sync_quick(tmp_path):
    doc = run_quick("adapter_sync", tmp_path)
    assert doc["quick"] is True
    assert {"full_path", "transport", "targets", "targets_met"} <= set(doc)
    (row,) = doc["full_path"]
    assert "error" not in row, row.get("error")
    for mode in ("adapter", "merged"):
        assert {"total_s", "broadcast_s", "publish_to_served_s"} <= set(row[mode])
        assert {"p50", "p95"} <= set(row[mode]["total_s"])
    payloads = doc["transport"]["payloads"]
    assert {"adapter_r1", "adapter_r8", "merged", "merged_full_extrapolated"} <= set(payloads)
    for stage in ("put_s", "broadcast_s", "fetch_s", "load_s", "total_s"):
        assert {"p50", "p95"} <= set(payloads["adapter_r1"][stage])
    assert payloads["adapter_r1"]["bytes_ratio_merged_over_adapter"] > 1


@pytest.mark.bench  # base and adapters in one engine's batch: test_replica (71 s of CI saved)
def test_bench_lora_overhead_quick(tmp_path):
    doc = run_quick("lora_overhead", tmp_path)
    assert doc["quick"] is True
    rows = doc["rows"]
    assert {"base", "one_adapter", "mixed_adapters"} <= set(rows)
    for r in rows.values():
        assert {"tokens_per_s_median", "ratio_vs_base", "tokens_per_s_rounds"} <= set(r)
        assert r["output_tokens"] == doc["prompts"] * doc["max_tokens"]
    assert rows["base"]["ratio_vs_base"] == 1.0


@pytest.mark.bench  # the policies' routing is in test_router_serve; this runs the whole benchmark
def test_routing_quick(tmp_path):
    doc = run_quick("routing", tmp_path, timeout=420)
    assert doc["quick"] is True
    assert {"policies", "workload", "targets", "targets_met", "targets_why", "ratios"} <= set(doc)
    rows = {r["policy"]: r for r in doc["policies"]}
    assert {"prefix", "round_robin"} <= set(rows)
    for r in rows.values():
        assert "error" not in r, r.get("error")
        assert {"tokens_per_s", "output_tokens_per_s", "engine", "placement", "router", "ttft"} <= set(r)
        assert {"hits", "queries", "hit_rate"} <= set(r["engine"])
        assert {"affinity_first_sight", "implied_hit_rate", "ideal_hit_rate"} <= set(r["placement"])
        assert {"p50", "p95"} <= set(r["ttft"]["ttft_s"])
        assert r["ttft"]["errors"] == 0
        assert r["engine"]["queries"] > 0
    assert {"affinity_rate", "spill_rate", "predicted_hit_rate"} <= set(rows["prefix"]["router"])
    assert {"affinity_ge_87pct", "spill_le_1pct", "tokens_per_s_ge_1.3x_round_robin"} <= set(doc["targets_met"])
    assert "tokens_per_s" in doc["ratios"]["prefix_over_round_robin"]


def test_router_overhead_quick(tmp_path):
    doc = run_quick("router_overhead", tmp_path)
    assert doc["rows"] and {"meta", "rows", "quality"} <= set(doc)


@pytest.mark.bench  # Ray Train + DeepSpeed steps and publishes: test_trainer_ray, test_trainer
def test_trainer_quick(tmp_path):
    doc = run_quick("trainer", tmp_path)
    assert doc["quick"] is True and [r["workers"] for r in doc["results"]] == [1, 2]
    assert all(r["adapter_bytes"] > 0 for r in doc["results"])


@pytest.mark.bench  # sync mode end to end is in test_job_submit; this runs the whole benchmark
def test_async_vs_sync_quick(tmp_path):
    doc = run_quick("async_vs_sync", tmp_path, timeout=600)
    assert set(doc["results"]) == {"sync", "async"}
    assert all(r["steps"] == doc["steps"] for r in doc["results"].values())


@pytest.mark.bench
def test_node_loss_quick(tmp_path):
    """A local cluster of a head and three worker nodes: the node of a vLLM replica, then the node of
    a train worker, are removed mid-run; the run finishes every step with nothing lost, doubled or skipped.
    A `bench` test: tests/test_unplaceable.py runs the same losses (and then an unplaceable stop and its resume)
    in CI."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "app", "bench", "node_loss", "--quick", "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"node_loss exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    doc = json.loads((tmp_path / "node_loss_quick.json").read_text())
    assert doc["completed"] and doc["steps"] == doc["config"]["steps"]
    assert [(f["fault"], f["injected"], f.get("survived")) for f in doc["faults"]] == [
        ("replica", True, True), ("train_worker", True, True)], doc["faults"]
    data = doc["data"]
    assert data["groups_trained"] == data["groups_expected"]
    assert {k: data[k] for k in ("step_rows_duplicated", "step_rows_missing", "samples_lost", "samples_doubled",
                                 "prompts_replayed", "prompts_skipped")} == dict.fromkeys(
        ("step_rows_duplicated", "step_rows_missing", "samples_lost", "samples_doubled", "prompts_replayed",
         "prompts_skipped"), 0)


@pytest.mark.bench
def test_length_tail_quick(tmp_path):
    """The three runs on the same long-tailed lengths; their lengths are recorded beside the results."""
    doc = run_quick("length_tail", tmp_path, timeout=900)
    assert set(doc["results"]) == {"sync", "async", "async-partial"}
    assert all(r["steps"] == doc["steps"] for r in doc["results"].values())
    assert doc["lengths"]["max"] <= doc["length_tail"]["hi"] and doc["lengths"]["p50"] < doc["lengths"]["max"]
