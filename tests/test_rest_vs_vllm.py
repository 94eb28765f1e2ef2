"""benchmarks/rest_vs_vllm.py --smoke: our REST endpoint (Ray Serve, one replica, policy-v1 through the
registry), the same replica's own REST port, and vLLM's own api_server with the same engine arguments and
adapter, each loaded in turn by vLLM's serving benchmark client, completions and chat, streaming. A `bench`
test (a few minutes: two engines start): the script runs as a subprocess that starts and stops its own Ray
and vLLM server."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
METRICS = ("output_tok_s", "request_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms")


@pytest.mark.bench
def test_smoke_measures_both_servers(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "rest_vs_vllm.py"), "--smoke", "--out", str(out),
                           "--work", str(work)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "round 2/2" in proc.stdout and "rest_vs_vllm_serve_cpu" in proc.stdout  # progress lines, then the table
    doc = json.loads((out / "rest_vs_vllm_cpu.json").read_text())
    w = doc["workload"]
    assert (w["input_len"], w["output_len"], w["concurrency"], w["rounds"]) == (48, 32, 16, 2)
    assert len(doc["rounds"]) == 2 and doc["rounds"][0]["order"] == ["rest", "direct", "vllm"]
    assert doc["rounds"][1]["order"] == ["vllm", "direct", "rest"]  # A B C C B A
    for ep in ("completions", "chat"):
        s = doc["endpoints"][ep]
        for side in ("rest", "direct", "vllm"):
            for r in doc["rounds"]:
                run = r[ep][side]
                assert run["completed"] == w["requests"] and not run["failed"], run
                assert run["output_tokens"] == w["requests"] * w["output_len"], run  # EOS ignored: every token
                assert run["cpu_ms_per_request"]["client"] > 0
            assert all(s[side][k] > 0 for k in METRICS), s[side]
        assert set(doc["rounds"][0][ep]["rest"]["cpu_ms_per_request"]) >= {"proxy", "ingress", "replica"}
        assert set(doc["rounds"][0][ep]["direct"]["cpu_ms_per_request"]) == {"replica", "client"}
        assert len(s["ratio_runs"]) == 1  # the first round warms up
        assert s["ratio"] == s["ratio_runs"][0] == s["rest"]["output_tok_s"] / s["vllm"]["output_tok_s"]
        assert s["direct_ratio"] == s["direct"]["output_tok_s"] / s["vllm"]["output_tok_s"]
    ratios = [doc["endpoints"][ep]["ratio"] for ep in ("completions", "chat")]
    assert doc["rest_vs_vllm_serve_cpu"] == min(ratios) and "lower" in doc["rest_vs_vllm_serve_cpu_is"]
    assert doc["met"] == (min(ratios) >= 0.9)
    direct = [doc["endpoints"][ep]["direct_ratio"] for ep in ("completions", "chat")]
    assert doc["rest_vs_vllm_serve_cpu_replica_port"] == min(direct) and doc["met_replica_port"] == (min(direct) >= 0.9)
    kw = doc["settings"]["engine_kwargs"]
    cmd = doc["settings"]["vllm_server_cmd"]
    assert kw["enable_lora"] and f"--max-lora-rank={kw['max_lora_rank']}" in "=".join(cmd)
    assert "--enable-lora" in cmd and "--enforce-eager" in cmd and "policy-v1=" in " ".join(cmd)
    assert doc["settings"]["engine_env"]["VLLM_CPU_KVCACHE_SPACE"]
    assert doc["machine"]["cpus"] >= 1 and doc["command"].startswith("python benchmarks/rest_vs_vllm.py")
    assert (out / "rest_vs_vllm_cpu.png").stat().st_size > 0
    assert "Application startup complete" in (work / "vllm_server.log").read_text()
