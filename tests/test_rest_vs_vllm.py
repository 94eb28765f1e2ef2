"""benchmarks/rest_vs_vllm.py --smoke: our REST endpoint (Ray Serve, one replica, policy-v1 through the
registry), the REST front (HAProxy to the same replica's own port), and vLLM's own api_server with the same
engine arguments and adapter, each loaded in turn by vLLM's serving benchmark client, completions and chat,
streaming. A `bench` test (a few minutes: two engines start): the script runs as a subprocess that starts and
stops its own Ray and vLLM server."""
import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks import rest_vs_vllm as rv
from common.ports import free_port

REPO = Path(__file__).resolve().parents[1]
METRICS = ("output_tok_s", "request_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms")


@pytest.mark.bench
def test_smoke_measures_both_servers(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    # all three sides (the default is the front alone, against vLLM)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.rest_vs_vllm", "--smoke", "--sides", "rest,front",
                           "--out", str(out), "--work", str(work)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "round 2/2" in proc.stdout and "rest_vs_vllm_serve_cpu" in proc.stdout  # progress lines, then the table
    for stage in ("vLLM api_server launched", "vLLM api_server ready", "our service: deploying",
                  "REST service healthy", "both ready", "pass 12/12"):
        assert stage in proc.stdout, stage
    assert not (out / "rest_vs_vllm_cpu_partial.json").exists()  # rewritten during the run, removed at its end
    doc = json.loads((out / "rest_vs_vllm_cpu.json").read_text())
    starts = doc["settings"]["server_start_s"]
    assert starts["start_order"] == "together"  # the CPU default: both servers start at once
    assert 0 < starts["vllm_s"] <= starts["both_ready_s"] and 0 < starts["rest_s"] <= starts["both_ready_s"]
    w = doc["workload"]
    assert (w["input_len"], w["output_len"], w["concurrency"], w["rounds"]) == (48, 32, 16, 2)
    assert len(doc["rounds"]) == 2 and doc["rounds"][0]["order"] == ["rest", "front", "vllm"]
    assert doc["rounds"][1]["order"] == ["vllm", "front", "rest"]  # A B C C B A
    for ep in ("completions", "chat"):
        s = doc["endpoints"][ep]
        for side in ("rest", "front", "vllm"):
            for r in doc["rounds"]:
                run = r[ep][side]
                assert run["completed"] == w["requests"] and not run["failed"], run
                assert run["output_tokens"] == w["requests"] * w["output_len"], run  # EOS ignored: every token
                assert run["cpu_ms_per_request"]["client"] > 0
            assert all(s[side][k] > 0 for k in METRICS), s[side]
        assert set(doc["rounds"][0][ep]["rest"]["cpu_ms_per_request"]) >= {"proxy", "ingress", "replica"}
        assert set(doc["rounds"][0][ep]["front"]["cpu_ms_per_request"]) == {"haproxy", "replica", "client"}
        assert len(s["ratio_runs"]) == 1  # the first round warms up
        assert s["ratio"] == s["ratio_runs"][0] == s["rest"]["output_tok_s"] / s["vllm"]["output_tok_s"]
        assert s["front_ratio"] == s["front"]["output_tok_s"] / s["vllm"]["output_tok_s"]
    ratios = [doc["endpoints"][ep]["ratio"] for ep in ("completions", "chat")]
    assert doc["rest_vs_vllm_serve_cpu"] == min(ratios) and "lower" in doc["rest_vs_vllm_serve_cpu_is"]
    assert doc["met"] == (min(ratios) >= 0.9)
    front = [doc["endpoints"][ep]["front_ratio"] for ep in ("completions", "chat")]
    assert doc["rest_vs_vllm_serve_cpu_front"] == min(front) and doc["met_front"] == (min(front) >= 0.9)
    kw = doc["settings"]["engine_kwargs"]
    cmd = doc["settings"]["vllm_server_cmd"]
    assert kw["enable_lora"] and f"--max-lora-rank={kw['max_lora_rank']}" in "=".join(cmd)
    assert "--enable-lora" in cmd and "--enforce-eager" in cmd and "policy-v1=" in " ".join(cmd)
    assert doc["settings"]["engine_env"]["VLLM_CPU_KVCACHE_SPACE"]
    assert doc["machine"]["cpus"] >= 1 and doc["command"].startswith("python -m benchmarks.rest_vs_vllm")
    assert (out / "rest_vs_vllm_cpu.png").stat().st_size > 0
    assert "Application startup complete" in (work / "vllm_server.log").read_text()


def _fake_server(tmp_path, script: str, events: list) -> "rv.VllmServer":
    """A VllmServer whose command is `script` (a stand-in for vLLM's api_server: no engine, no Ray)."""
    port = free_port()
    return rv.VllmServer([sys.executable, "-c", textwrap.dedent(script).replace("PORT", str(port))], port,
                         tmp_path / "server.log", on_event=events.append, timeout_s=60)


def test_server_watch_sees_its_kv_cache_then_ready(tmp_path):
    events = []
    srv = _fake_server(tmp_path, """
        import http.server, time
        print("loading weights", flush=True)
        time.sleep(1.5)
        print("(EngineCore pid=1) INFO [kv_cache_utils.py:2327] GPU KV cache size: 1,000 tokens", flush=True)
        time.sleep(1.5)
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.end_headers()
        http.server.HTTPServer(("127.0.0.1", PORT), H).serve_forever()
        """, events)
    try:
        srv.wait_kv()
        assert srv.kv_s is not None and srv.kv_s >= 1
        srv.wait_ready()
        assert srv.ready_s > srv.kv_s
        assert [e.split(" (")[0] for e in events] == ["vLLM api_server: its engine allocates its KV cache",
                                                      f"vLLM api_server ready on :{srv.port}"], events
    finally:
        srv.close()
    assert srv.proc.returncode is not None


def test_server_exit_ends_both_waits(tmp_path):
    events = []
    srv = _fake_server(tmp_path, "import sys; print('boom', flush=True); sys.exit(3)", events)
    try:
        with pytest.raises(RuntimeError, match=r"exited \(3\)"):
            srv.wait_kv()  # a server that dies before its KV cache does not keep our service waiting
        with pytest.raises(RuntimeError):
            srv.wait_ready()
        assert "boom" in srv.log_tail() and events[-1].startswith("vLLM api_server failed")
    finally:
        srv.close()


def test_partial_document_has_the_passes_done_and_why(tmp_path, capsys):
    path = tmp_path / "rest_vs_vllm_cpu_partial.json"
    progress = rv.Progress(path, {"command": "python -m benchmarks.rest_vs_vllm --smoke"}, passes=12)
    progress.stage("starting")
    doc = json.loads(path.read_text())
    assert doc["partial"] and doc["passes_done"] == 0 and doc["passes"] == 12 and doc["rounds"] == []
    assert doc["partial_reason"] == "running, 0 of 12 passes done; last stage: starting"
    assert doc["command"].endswith("--smoke") and doc["stages"][0]["what"] == "starting"
    assert "starting" in capsys.readouterr().out  # and printed, with its time
    progress.starts["vllm_s"] = 30.0
    row = {"order": ["rest", "front", "vllm"], "completions": {"rest": {"output_tok_s": 600.0}}}
    progress.rounds.append(row)
    progress.stage("round 1/2 (warm-up) completions rest  : 600 tok/s")
    doc = json.loads(path.read_text())
    assert doc["passes_done"] == 1 and doc["rounds"] == [row] and doc["server_start_s"] == {"vllm_s": 30.0}
    assert doc["partial_reason"].startswith("running, 1 of 12 passes done")
    progress.write("stopped after 1 of 12 passes: SystemExit: 143", vllm_server_log_tail="...")
    doc = json.loads(path.read_text())
    assert doc["partial_reason"].endswith("SystemExit: 143") and doc["vllm_server_log_tail"] == "..."
    assert len(doc["stages"]) == 2 and not list(tmp_path.glob("*.tmp"))


def test_a_pass_whose_requests_all_failed_names_the_first_error():
    """A side that fails every request stops the benchmark with the client's error text (kept by
    --save-detailed), rather than running the other passes and reporting only zeros."""
    assert "--save-detailed" in rv.client_argv("completions", 1, Path("m"), 4, 0)
    failed = {"completed": 0, "failed": 4, "errors": {"Not Found": 3, "Bad Request": 1}}
    assert rv.all_failed(failed) == "all 4 requests failed; first error: Not Found"
    assert rv.all_failed({"completed": 1, "failed": 3, "errors": {"Not Found": 3}}) is None
    assert rv.all_failed({"completed": 4, "failed": 0}) is None
    summary = rv.summarize([{ep: {side: {**{k: 0 for k in rv.METRICS}, **failed, "cpu_ms_per_request": {}}
                                   for side in rv.SIDES} for ep in rv.ENDPOINTS}])
    assert summary["chat"]["rest"]["errors"] == {"Not Found": 3, "Bad Request": 1}
    assert summary["chat"]["ratio"] is None and "n/a" in rv.table(summary)


def _pass(tok_s: float) -> dict:
    return {**{k: 1.0 for k in rv.METRICS}, "output_tok_s": tok_s, "ttft_p50_ms": 1e4 / tok_s, "completed": 160,
            "failed": 0, "cpu_ms_per_request": {"client": 1.0}}


def test_a_run_stopped_after_every_pass_is_finished_from_its_partial_document(tmp_path):
    """On the H200 a time limit killed a run while its servers stopped, every pass done and no document:
    `--finish` makes the document from the partial one (the same summary as a finished run), and refuses a
    partial with fewer than three complete rounds."""
    tok = {"rest": 600.0, "front": 950.0, "vllm": 1000.0}
    rounds = [{"order": list(order), **{ep: {s: _pass(tok[s] * (1.1 if ep == "chat" and s == "front" else 1) + r)
                                             for s in order} for ep in rv.ENDPOINTS}}
              for r, order in enumerate([("rest", "front", "vllm"), ("vllm", "front", "rest"),
                                         ("rest", "front", "vllm")])]
    path = tmp_path / "rest_vs_vllm_gpu_partial.json"
    progress = rv.Progress(path, {"command": "python -m benchmarks.rest_vs_vllm", "work_dir": str(tmp_path),
                                  "workload": {**rv.WORKLOAD, "rounds": 3, "shape": "qwen2.5-1.5b"},
                                  "vllm_server_cmd": ["python", "-m", "vllm.entrypoints.openai.api_server"]},
                           passes=12)
    progress.rounds.extend(rounds[:1])
    progress.write("stopped after 6 of 12 passes: SystemExit: 137")
    finish = [sys.executable, "-m", "benchmarks.rest_vs_vllm", "--finish", str(path)]
    proc = subprocess.run(finish, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "1 complete round(s) (6 of 12 passes were done)" in proc.stderr, proc.stderr
    assert not (tmp_path / "rest_vs_vllm_gpu.json").exists()

    progress.passes = 18
    progress.rounds[:] = rounds
    progress.write("all 18 passes done; stopping the servers, then the final document")
    proc = subprocess.run(finish, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads((tmp_path / "rest_vs_vllm_gpu.json").read_text())
    # Rounds 2 and 3 are measured: completions rest (601/1001, 602/1002), the lower of the two endpoints.
    serve = statistics.median([(600 + r) / (1000 + r) for r in (1, 2)])
    assert doc["rest_vs_vllm_serve_gpu"] == pytest.approx(serve) and not doc["met"]
    front = statistics.median([(950 + r) / (1000 + r) for r in (1, 2)])  # completions: chat's front is 1.1x
    assert doc["rest_vs_vllm_serve_gpu_front"] == pytest.approx(front) and doc["met_front"]
    assert doc["endpoints"]["chat"]["front_ratio"] > 1 and doc["rounds"] == json.loads(json.dumps(rounds))
    done = doc["finished_from_partial"]
    assert done["file"] == path.name and "all 18 passes" in done["reason"]
    settings = doc["settings"]
    assert settings["vllm_server_cmd"][-1].endswith("api_server") and "vllm bench serve" in settings["client"]
    assert (tmp_path / "rest_vs_vllm_gpu.png").stat().st_size > 0 and path.exists()
    assert "rest_vs_vllm_serve_gpu_front = 0.95" in proc.stdout


def test_a_run_cut_in_its_last_round_is_finished_from_its_complete_rounds(tmp_path):
    """On an H100 the rest phase's limit cut a run at pass 22 of 24 (its last round without chat's front and vLLM):
    the cut round is dropped whole, the document says so, and the ratios are the complete rounds'."""
    tok = {"rest": 600.0, "front": 950.0, "vllm": 1000.0}
    orders = [("rest", "front", "vllm"), ("vllm", "front", "rest")] * 2
    rounds = [{"order": list(o), **{ep: {s: _pass(tok[s] + r) for s in o} for ep in rv.ENDPOINTS}}
              for r, o in enumerate(orders)]
    rounds[3]["chat"] = {"vllm": _pass(1003.0)}  # cut after the chat endpoint's first side
    path = tmp_path / "rest_vs_vllm_gpu_partial.json"
    progress = rv.Progress(path, {"command": "python -m benchmarks.rest_vs_vllm", "work_dir": str(tmp_path),
                                  "workload": {**rv.WORKLOAD, "rounds": 4, "shape": "qwen2.5-1.5b"}}, passes=24)
    progress.rounds.extend(rounds)
    progress.write("running, 22 of 24 passes done")
    assert progress.passes_done() == 22
    proc = subprocess.run([sys.executable, "-m", "benchmarks.rest_vs_vllm", "--finish", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads((tmp_path / "rest_vs_vllm_gpu.json").read_text())
    done = doc["finished_from_partial"]
    assert (done["rounds_used"], done["rounds_cut"], done["passes_done"], done["passes"]) == (3, 1, 22, 24)
    front = statistics.median([(950 + r) / (1000 + r) for r in (1, 2)])  # rounds 2 and 3; round 4 is cut
    assert doc["rest_vs_vllm_serve_gpu_front"] == pytest.approx(front) and len(doc["rounds"]) == 3
