"""benchmarks/rest_vs_vllm.py's load: one pass of vLLM's serving benchmark client (`vllm bench serve`, in this
process) against a side, with the CPU seconds each of the side's processes used; the probe request before the
passes; and, when a side fails, what its actors and Serve logs said."""
from __future__ import annotations

import collections
import contextlib
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks._common import cpu_s_between, process_tree_cpu_s
from benchmarks._rest_vs_vllm_common import ENDPOINTS, METRICS, REST_PROCS, WORKLOAD, log
from benchmarks._rest_vs_vllm_servers import VllmServer
from common.processes import descendant_pids


def client_argv(endpoint: str, port: int, model: Path, requests: int, seed: int) -> list[str]:
    """`vllm bench serve` arguments of one pass."""
    backend, path = ENDPOINTS[endpoint]
    w = WORKLOAD
    return ["--backend", backend, "--endpoint", path, "--host", "127.0.0.1", "--port", str(port),
            "--model", w["model_name"], "--tokenizer", str(model), "--dataset-name", w["dataset"],
            "--random-input-len", str(w["input_len"]), "--random-output-len", str(w["output_len"]),
            "--num-prompts", str(requests), "--max-concurrency", str(w["concurrency"]), "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--disable-tqdm",
            "--save-detailed"]  # keeps the per-request errors in the result (dropped otherwise)


def run_client(argv: list[str], log_file) -> dict:
    """One `vllm bench serve` pass in this process (its output to `log_file`); its result dict."""
    import asyncio

    from vllm.benchmarks.serve import add_cli_args, main_async
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(argv)
    log_file.write(f"\n===== vllm bench serve {' '.join(argv)}\n")
    log_file.flush()
    with contextlib.redirect_stdout(log_file), contextlib.redirect_stderr(log_file):
        return asyncio.run(main_async(args))


def side_pids(side: str, server: VllmServer, front_pid: int | None = None) -> dict[str, int]:
    if side == "vllm":
        return {"server": server.proc.pid}
    out = {"haproxy": front_pid} if side == "front" and front_pid else {}
    for name, title in REST_PROCS.items() if side == "rest" else [("replica", REST_PROCS["replica"])]:
        pids = descendant_pids(title)
        if pids:
            out[name] = min(pids)
    return out


def one_pass(side: str, endpoint: str, ports: dict, server: VllmServer, model: Path, requests: int, seed: int,
             log_file, front_pid: int | None = None) -> dict:
    pids = side_pids(side, server, front_pid)
    before = {name: process_tree_cpu_s([pid]) for name, pid in pids.items()}
    client0 = time.process_time()
    res = run_client(client_argv(endpoint, ports[side], model, requests, seed), log_file)
    client_cpu = time.process_time() - client0
    after = {name: process_tree_cpu_s([pid]) for name, pid in pids.items()}
    out = {k: res.get(v) for k, v in METRICS.items()}
    done = max(1, out["completed"] or 0)
    out["cpu_ms_per_request"] = {name: 1000 * cpu_s_between(before[name], after[name]) / done for name in pids}
    out["cpu_ms_per_request"]["client"] = 1000 * client_cpu / done
    errors = collections.Counter(e.strip()[-500:] for e in res.get("errors") or [] if e)
    if errors:
        out["errors"] = dict(errors.most_common(3))  # the distinct messages, with how many requests got each
    return out


def probe(port: int, endpoint: str, timeout_s: float = 120.0, max_tokens: int = 4, stream: bool = False) -> dict:
    """One small request to a side, before the passes: its status, the start of its body and its seconds.
    The benchmark client keeps only a failed request's HTTP reason ("Internal Server Error"); the body
    says what went wrong. (benchmarks/probes/rest_latency.py times requests with it.)"""
    path = ENDPOINTS[endpoint][1]
    body = ({"prompt": "1 2 3"} if endpoint == "completions" else
            {"messages": [{"role": "user", "content": "1 2 3"}]})
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method="POST",
                                 data=json.dumps({"model": WORKLOAD["model_name"], "max_tokens": max_tokens,
                                                  "stream": stream, **body}).encode(),
                                 headers={"Content-Type": "application/json"})
    t = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            status, text = r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode(errors="replace")
    except Exception as e:  # refused, reset, timed out
        status, text = None, f"{type(e).__name__}: {e}"
    return {"status": status, "body": text[:2000], "seconds": round(time.perf_counter() - t, 5)}


def all_failed(res: dict) -> str | None:
    """Why a pass is of no use: every request failed (the first error, for the log); None otherwise."""
    if res.get("completed") or not res.get("failed"):
        return None
    first = next(iter(res.get("errors") or {}), "no error text")
    return f"all {res['failed']} requests failed; first error: {first}"


def service_errors(per_file: int = 12) -> str:
    """What a failing REST side said, since the client sees only a status and a reason: the death cause of
    every dead actor of this Ray session, then per Serve log (proxy, Ingress, replica) and per worker
    stderr its last ERROR / Traceback / fatal lines."""
    import ray

    out = []
    try:  # the GCS's actor table (ray.util.state would need the dashboard)
        from ray._private.state import actors

        for a in actors().values():
            if a.get("State") == "DEAD":
                cause = str(a.get("DeathCause"))[:1500]
                out.append(f"dead actor {a.get('ActorClassName')} pid {a.get('Pid')}: {cause}")
    except Exception as e:
        out.append(f"(no actor table: {e})")
    try:
        logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    except Exception:
        return "\n".join(out)
    marks = (" ERROR ", "Traceback", "Error", "Fatal", "Segmentation", "SIGSEGV", "SIGABRT", "core dumped",
             "Aborted", "CUDA", "Killed")
    for f in sorted([*logs.glob("serve/*.log"), *logs.glob("worker-*.err")]):
        text = f.read_text(errors="replace").splitlines()
        lines = [line for line in text if any(m in line for m in marks)]
        out += [f"{f.name}: {line[:400]}" for line in lines[-per_file:]]
        last = max((i for i, line in enumerate(text) if "Traceback" in line), default=None)
        if last is not None:  # the newest traceback: its head (which call) and its tail (which error)
            end = next((j for j in range(last + 1, len(text)) if text[j][:1].strip()), len(text) - 1)
            tb = text[last:end + 1]
            tb = tb if len(tb) <= 40 else [*tb[:4], "...", *tb[-32:]]
            out.append(f"{f.name}: last traceback:")
            out += [f"    {line[:400]}" for line in tb]
    return "\n".join(out)


def log_service_errors() -> None:
    log(f"service errors:\n{service_errors()}")
