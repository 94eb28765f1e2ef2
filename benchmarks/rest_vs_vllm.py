"""Issue 20, goal 7: our REST endpoint against vLLM's own OpenAI server, same model, adapter and engine.

Both servers run at once, each with the engine arguments the replica gets (`engine_kwargs(cfg)`, its
environment `engine_env(cfg)`):
- REST: our service (Ray Serve: proxy -> Ingress -> one RolloutReplica), a random rank-8 LoRA published as
  policy-v1 through the adapter registry before the app starts (what `app serve --adapter` does);
- direct: the same replica's own REST port (`rollout.replica_http_port`, serve_deployments/replica_http.py:
  the same checks and names, in the engine's process, no routing);
- vLLM: `python -m vllm.entrypoints.openai.api_server` with those arguments as flags and the same adapter
  as `--lora-modules policy-v1=DIR`.
vLLM's own serving benchmark client (`vllm bench serve`, run in this process through
vllm.benchmarks.serve.main_async) loads one of them at a time: backend openai (/v1/completions) and
openai-chat (/v1/chat/completions), streaming, the random dataset (48 input, 32 output tokens, EOS ignored),
16 concurrent, 160 requests, model policy-v1. Rounds interleave the sides A B B A (the host drifts, and
shares its cores with other work); each pass's prompts are the round's (one seed per round, both sides
the same); the first round is a warm-up. A ratio is the median over rounds of REST / vLLM output tok/s
within the round. Each pass also records the CPU seconds every process of each side used, per request.

    python -m benchmarks.rest_vs_vllm [--smoke] [--rounds N] [--requests N] [--out DIR] [--work DIR]
                                      [--start-order together|after-kv|serial] [--direct-ingress]
    python -m benchmarks.rest_vs_vllm --finish OUT/rest_vs_vllm_gpu_partial.json
    python -m app bench rest_vs_vllm

Both servers start at once on CPU; on a GPU ours deploys once vLLM's server has allocated its KV cache
(--start-order, START_ORDERS). Before the passes, one small request per side and endpoint records its status and body
(`server_start_s.probes`): the client keeps only a failed request's HTTP reason. A pass whose requests
all fail stops the run, printing the dead actors' causes and the Serve logs' error lines. Stages and passes
are logged with their time as they happen, and OUT/rest_vs_vllm_{cpu|gpu}_partial.json is rewritten at each
stage and after each pass (the passes done, the stages, why it is partial), so a run killed by a time limit
leaves what it measured; a finished run removes it. The final document is written once the passes are done,
before the servers stop; a run killed while they stop leaves a partial with every pass, which `--finish`
turns into the final document.

Writes OUT/rest_vs_vllm_{cpu|gpu}.json (`rest_vs_vllm_serve_{cpu|gpu}`: the lower of the completions and
chat ratios through the Serve port; `..._replica_port`: the same through the replica's own port) and a PNG
beside it; prints a table. Server logs and the client's output stay in --work.
On a GPU machine (untested here) the replica and the vLLM server each get 0.4 of GPU 0 and the model is
the `qwen2.5-1.5b` shape.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from app.tiny_model import serve_config
from benchmarks._common import cpu_s_between, process_tree_cpu_s
from common.lora_payloads import make_lora_payload
from common.ports import free_port
from common.processes import descendant_pids

REPO = Path(__file__).resolve().parents[1]

WORKLOAD = {"input_len": 48, "output_len": 32, "concurrency": 16, "requests": 160, "rounds": 4, "lora_rank": 8,
            "dataset": "random", "streaming": True, "ignore_eos": True, "model_name": "policy-v1"}
SMOKE = {"requests": 32, "rounds": 2}
ENDPOINTS = {"completions": ("openai", "/v1/completions"), "chat": ("openai-chat", "/v1/chat/completions")}
SIDES = ("rest", "front", "vllm")  # --sides picks ours; vllm always last
SIDE_LABELS = {"rest": "our REST (Serve port: proxy -> Ingress -> replica)",
               "front": "our REST front (HAProxy -> replica port)",
               "direct": "our REST (replica port)", "vllm": "vLLM api_server"}
# A side's ratio keys: "{prefix}ratio" in a summary, "rest_vs_vllm_serve_{device}{suffix}" in the document.
PREFIX = {"rest": "", "front": "front_", "direct": "direct_"}
SUFFIX = {"rest": "", "front": "_front", "direct": "_replica_port"}
WHERE = {"rest": "Serve port", "front": "REST front", "direct": "replica port"}
GOAL = 0.9
# The Serve processes of our side whose CPU time a pass records (Ray titles them ray::NAME).
REST_PROCS = {"proxy": "ProxyActor", "ingress": "ServeReplica:policy:Ingress",
              "replica": "ServeReplica:policy:RolloutReplica"}
METRICS = {"output_tok_s": "output_throughput", "request_s": "request_throughput", "ttft_p50_ms": "median_ttft_ms",
           "ttft_p99_ms": "p99_ttft_ms", "tpot_p50_ms": "median_tpot_ms", "itl_p50_ms": "median_itl_ms",
           "e2el_p50_ms": "median_e2el_ms", "completed": "completed", "failed": "failed",
           "output_tokens": "total_output_tokens", "duration_s": "duration"}


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


def service_config(model: Path, gpus: int):
    """The one Config both sides' engines come from: one replica of `model`, the benchmark's LoRA rank."""
    cfg = serve_config(model, replicas=1, max_lora_rank=WORKLOAD["lora_rank"])
    if gpus:
        cfg = cfg.replace(model={"dtype": "bfloat16", "max_model_len": 2048}, train={"use_gpu": True},
                          rollout={"gpus_per_replica": 1, "gpu_memory_utilization": 0.4, "enforce_eager": False,
                                   "max_num_seqs": 256})
    return cfg


def engine_flags(kwargs: dict) -> list[str]:
    """`engine_kwargs(cfg)` as vLLM CLI flags (bools as --x / --no-x, dicts as JSON)."""
    out = []
    for k, v in kwargs.items():
        if k == "model" or v is None:
            continue
        flag = "--" + k.replace("_", "-")
        if k == "disable_log_stats":  # a plain store_true flag
            out += [flag] if v else []
        elif isinstance(v, bool):
            out.append(flag if v else "--no-" + flag[2:])
        else:
            out += [flag, json.dumps(v) if isinstance(v, dict) else str(v)]
    return out


# vLLM's EngineCore logs this just before it allocates its KV cache ("GPU KV cache size: N tokens", from vLLM
# 0.8 on): past it, that server's memory profiling is done.
KV_LINE = b"KV cache size:"


# Resolved here, before any fork: the child only calls it.
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def _die_with_parent():
    """preexec_fn: the server gets SIGTERM when this process dies, even by SIGKILL (a lease or a pipeline's
    limit kills this process's group, and the server has its own session): Linux's PR_SET_PDEATHSIG."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` in its own process group (stopped as a group), started
    at once; a thread watches its log and /health, so our service starts while this one does
    (`wait_kv`, `wait_ready`). `kv_s` / `ready_s`: seconds from launch to its KV cache / its /health 200."""

    def __init__(self, cmd: list[str], port: int, log_path: Path, env: dict | None = None,
                 env_extra: dict | None = None, on_event=None, timeout_s: float = 900):
        """Launch `cmd`, a server that answers GET /health on `port` once ready (`for_engine`: vLLM's own);
        `env` and `env_extra` (recorded apart: what the replica's engine gets, and what only this one
        does) go on top of this process's environment."""
        self.cmd, self.port, self.log_path = cmd, port, log_path
        self.env, self.env_extra = dict(env or {}), dict(env_extra or {})
        full_env = dict(os.environ, **{**self.env, **self.env_extra}, PYTHONPATH=os.pathsep.join(filter(None, [
            str(REPO), os.environ.get("PYTHONPATH")])), PYTHONUNBUFFERED="1")
        self._start(full_env, on_event, timeout_s)

    @classmethod
    def for_engine(cls, cfg, adapter: Path, log_path: Path, on_event=None, timeout_s: float = 900,
                   log_kv: bool = False) -> VllmServer:
        """vLLM's api_server on the engine settings our replica gets from `cfg`, serving `adapter`."""
        from serve_deployments.engine_config import engine_env, engine_kwargs

        port = free_port()
        kw = engine_kwargs(cfg)
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", kw["model"],
               *engine_flags(kw), "--lora-modules", f"{WORKLOAD['model_name']}={adapter}",
               "--host", "127.0.0.1", "--port", str(port)]
        env = engine_env(cfg)  # the replica's engine gets the same
        # `log_kv`: its engine's INFO lines (at startup; with disable_log_stats none while serving), for KV_LINE.
        extra = ({"VLLM_LOGGING_LEVEL": "INFO"} if log_kv and env.get("VLLM_LOGGING_LEVEL", "INFO")
                 not in ("INFO", "DEBUG") else {})
        return cls(cmd, port, log_path, env, extra, on_event, timeout_s)

    def _start(self, env: dict, on_event, timeout_s: float) -> None:
        """Launch self.cmd (output to self.log_path) and the thread that watches it and self.port's /health."""
        self._log = open(self.log_path, "w")  # closed in close()
        self.on_event = on_event or log
        self.kv_s = self.ready_s = self.error = None
        self._kv, self._done, self._closing = threading.Event(), threading.Event(), False
        self.launched = time.time()
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=_die_with_parent)
        self._watch = threading.Thread(target=self._watch_loop, args=(timeout_s,), name="vllm-server-watch",
                                       daemon=True)
        self._watch.start()

    def _watch_loop(self, timeout_s: float) -> None:
        deadline, pos, tail = time.monotonic() + timeout_s, 0, b""
        try:
            while not self._closing:
                if self.kv_s is None:
                    with open(self.log_path, "rb") as f:
                        f.seek(pos)
                        chunk = f.read()
                    pos += len(chunk)
                    if KV_LINE in tail + chunk:
                        self.kv_s = time.time() - self.launched
                        self.on_event(f"vLLM api_server: its engine allocates its KV cache ({self.kv_s:.0f}s "
                                      "after launch)")
                        self._kv.set()
                    tail = chunk[-len(KV_LINE):] if chunk else tail
                if self.proc.poll() is not None:
                    raise RuntimeError(f"vLLM server exited ({self.proc.returncode}); log {self.log_path}")
                with contextlib.suppress(OSError):
                    with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                        if r.status == 200:
                            self.ready_s = time.time() - self.launched
                            self.on_event(f"vLLM api_server ready on :{self.port} ({self.ready_s:.0f}s after "
                                          "launch)")
                            return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"vLLM server not ready after {timeout_s:.0f}s; log {self.log_path}")
                time.sleep(1)
        except Exception as e:
            self.error = e
            self.on_event(f"vLLM api_server failed: {e}")
        finally:
            self._kv.set()
            self._done.set()

    def _wait(self, event: threading.Event) -> None:
        while not event.wait(1):  # in slices: a signal's handler runs between them
            pass
        if self.error is not None:
            raise self.error

    def wait_kv(self) -> None:
        """Until its engine has profiled its memory and allocates its KV cache (or it is ready, or failed)."""
        self._wait(self._kv)

    def wait_ready(self) -> None:
        """Until /health answers 200; raises when the server exited or did not get there in time."""
        self._wait(self._done)

    def log_tail(self, chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""

    def close(self) -> None:
        self._closing = True
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._watch.join(timeout=10)
        self._log.close()


def start_rest(cfg, payload, before_deploy=None, progress=log, direct_ingress: bool = False,
               front: bool = False) -> tuple[dict, tuple]:
    """Our service on cfg.rollout.http_port, policy-v1 published before the app starts; waits until healthy
    (its reason to `progress` every ~30 s while not). `before_deploy()`, when given, runs after Ray is up and
    before the app (and so its engine) starts. Returns the ports ("rest": the service's, "direct": the
    replica's own REST port, "front": the REST front's when `front`) and what the caller holds while it serves
    (the registry's handle, the front or None): the registry
    dies with its owner's last handle, and then no request can be served (on the H200, 2026-12-04, every
    request of three sittings failed so).

    `direct_ingress`: Ray Serve's experimental direct ingress (RAY_SERVE_ENABLE_DIRECT_INGRESS, Ray 2.60): the
    Ingress replica listens itself and requests skip the proxy. Serve reads its port range from the
    environment of the processes Ray starts, so it is pinned to one free port before `ray.init`."""
    import ray

    from common.registry import get_or_create_registry
    from serve_deployments.app_builder import start_with_adapter, wait_healthy

    ingress_port = None
    if direct_ingress:
        ingress_port = free_port()
        os.environ.update(RAY_SERVE_ENABLE_DIRECT_INGRESS="1", RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT=str(ingress_port),
                          RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT=str(ingress_port + 1))
    ray.init(address="local", num_cpus=4, num_gpus=min(1, _gpus()), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false",
                                       "PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    # Picked after Ray's own agents bound theirs. Under direct ingress the (idle) proxy keeps this one, and
    # the Ingress must not ask for it: it would fail to bind and Serve would block the port.
    cfg = cfg.replace(rollout={"http_port": free_port(), "replica_http_port": 0})
    registry = get_or_create_registry()
    if before_deploy is not None:
        before_deploy()
    progress("our service: deploying (proxy, Ingress, one RolloutReplica; policy-v1 published first)")
    handle, version = start_with_adapter(cfg, registry, payload)
    assert version == 1, version
    progress("our service: deployed; waiting for its health (every replica up, holding policy-v1)")
    wait_healthy(handle, log=progress)
    replica_port = int(handle.stats.remote().result()["replicas"][0]["http_url"].rsplit(":", 1)[1].split("/")[0])
    ports = {"rest": ingress_port or cfg.rollout.http_port, "direct": replica_port}
    watch = None
    if front:
        from serve_deployments.haproxy_front import start_front

        cfg = cfg.replace(rollout={"front_port": 0})
        try:
            watch = start_front(cfg, handle)
        except (OSError, RuntimeError) as e:  # no HAProxy here: the other sides are still worth measuring
            progress(f"our REST front did not start, measured without it: {type(e).__name__}: {e}")
        else:
            ports["front"] = watch.front.port
            progress(f"our REST front: HAProxy on :{ports['front']} -> replica port :{replica_port}")
    return ports, (registry, watch)


def _jsonable(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)


class Progress:
    """Stage lines (timestamped, flushed, kept) and OUT/rest_vs_vllm_{device}_partial.json, rewritten at each
    stage and after each pass, so a run killed at any point leaves the passes it finished and where it
    stopped. A run that finishes removes it (its final document has everything)."""

    def __init__(self, path: Path, base: dict, passes: int):
        self.path, self.base, self.passes = path, base, passes
        self.rounds, self.starts, self.stages = [], {}, []
        self.t0 = time.time()
        self._lock = threading.RLock()

    def passes_done(self) -> int:
        return sum(len(row.get(ep, {})) for row in self.rounds for ep in ENDPOINTS)

    def stage(self, msg: str) -> None:
        log(msg)
        with self._lock:
            self.stages.append({"at": time.strftime("%H:%M:%S"), "s": round(time.time() - self.t0, 1), "what": msg})
            self.write(f"running, {self.passes_done()} of {self.passes} passes done; last stage: {msg}")

    def write(self, reason: str, **extra) -> None:
        with self._lock:
            doc = {"partial": True, "partial_reason": reason,
                   "partial_is": "rewritten at each stage and after each pass; a run that finishes removes it, so "
                                 "one left behind was stopped (killed, or failed as partial_reason says) after its "
                                 "last stage",
                   "passes_done": self.passes_done(), "passes": self.passes, **self.base,
                   "server_start_s": self.starts, "stages": self.stages, "rounds": self.rounds,
                   "wall_s": time.time() - self.t0, "updated_at": time.strftime("%Y-%m-%d %H:%M:%S"), **extra}
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps(doc, indent=2, default=_jsonable))
            os.replace(tmp, self.path)  # whole: a kill mid-write leaves the previous one


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


def _ratio_text(x, unit: str = "") -> str:
    return "n/a" if x is None else f"{x:.2f}{unit}"


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(rounds: list[dict]) -> dict:
    """Per endpoint: each side's medians over the measured rounds (all but the first), the ratio runs."""
    measured = rounds[1:] or rounds
    out = {}
    for ep in ENDPOINTS:
        sides = {}
        for side in SIDES:
            runs = [r[ep][side] for r in measured]
            sides[side] = {k: _median([x.get(k) for x in runs]) for k in METRICS}
            errors = collections.Counter()
            for x in runs:
                errors.update(x.get("errors") or {})
            if errors:
                sides[side]["errors"] = dict(errors.most_common(3))
            sides[side]["cpu_ms_per_request"] = {
                name: _median([x["cpu_ms_per_request"].get(name) for x in runs])
                for name in runs[0]["cpu_ms_per_request"]}
        out[ep] = sides
        for side in SIDES[:-1]:
            prefix = PREFIX[side]
            ratios = [r[ep][side]["output_tok_s"] / r[ep]["vllm"]["output_tok_s"] for r in measured
                      if r[ep][side]["output_tok_s"] and r[ep]["vllm"]["output_tok_s"]]
            ttft = [r[ep][side]["ttft_p50_ms"] / r[ep]["vllm"]["ttft_p50_ms"] for r in measured
                    if r[ep][side]["ttft_p50_ms"] and r[ep]["vllm"]["ttft_p50_ms"]]
            out[ep] |= {f"{prefix}ratio_runs": ratios, f"{prefix}ratio": _median(ratios),
                        f"{prefix}ttft_p50_ratio": _median(ttft)}
    return out


def machine(load_at_start: list[float]) -> dict:
    import ray
    import vllm

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    info = {"cpus": os.cpu_count(), "cpu_model": cpu, "platform": platform.platform(),
            "python": platform.python_version(), "vllm": vllm.__version__, "ray": ray.__version__,
            "load_avg_1_5_15_min_at_start": load_at_start, "load_avg_1_5_15_min_at_end": list(os.getloadavg())}
    if _gpus():
        import torch

        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def code_state() -> dict:
    """The commit measured, and the serving code's uncommitted changes (others edit the same tree)."""
    def git(*a):
        r = subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else None

    dirty = git("status", "--porcelain", "--", "serve_deployments", "common", "app")
    return {"commit": git("rev-parse", "HEAD"), "uncommitted_serving_files": dirty.splitlines() if dirty else []}


def table(summary: dict) -> str:
    head = f"{'endpoint':<12} {'side':<6} {'out tok/s':>9} {'req/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9}"
    lines = [head, "-" * len(head)]
    for ep, s in summary.items():
        for side in SIDES:
            m = {k: v or 0 for k, v in s[side].items()}
            lines.append(f"{ep:<12} {side:<6} {m['output_tok_s']:>9.0f} {m['request_s']:>7.2f} "
                         f"{m['ttft_p50_ms']:>7.0f}ms {m['ttft_p99_ms']:>7.0f}ms {m['tpot_p50_ms']:>7.1f}ms")
        for side in SIDES[:-1]:
            prefix, what = PREFIX[side], WHERE[side]
            ratio = _ratio_text(s[prefix + "ratio"], "x")
            lines.append(f"{ep:<12} {'ratio':<6} {ratio:>10}  ({what} / vLLM output tok/s, runs "
                         + ", ".join(f"{r:.2f}" for r in s[prefix + "ratio_runs"]) + ")")
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eps = list(ENDPOINTS)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "output_tok_s", "output tok/s (higher is better)"),
                           (axes[1], "ttft_p50_ms", "TTFT p50, ms (lower is better)")):
        for j, side in enumerate(SIDES):
            vals = [doc["endpoints"][ep][side][key] or 0 for ep in eps]
            bars = ax.bar([i + (j - (len(SIDES) - 1) / 2) * 0.27 for i in range(len(eps))], vals, 0.27,
                          label=SIDE_LABELS[side])
            for b, v in zip(bars, vals):
                ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(eps)), [f"{ep}\n" + "\n".join(
            f"{WHERE[side]} {_ratio_text(doc['endpoints'][ep][PREFIX[side] + 'ratio'], 'x')}" for side in SIDES[:-1])
            if key == "output_tok_s" else ep for ep in eps])
        ax.set_title(label, fontsize=9)
        ax.set_ylim(top=ax.get_ylim()[1] * 1.35)  # room for the legend above the bars
        ax.legend(fontsize=7, loc="upper left")
    key = next(k for k in doc if k.startswith("rest_vs_vllm_serve_"))
    fig.suptitle(", ".join(f"{WHERE[side]} {_ratio_text(doc.get(key + SUFFIX[side]), 'x')}" for side in SIDES[:-1])
                 + f" of vLLM (goal >= {GOAL}); "
                 f"{doc['workload']['requests']} requests, "
                 f"{doc['workload']['concurrency']} concurrent, {doc['workload']['input_len']} in / "
                 f"{doc['workload']['output_len']} out tokens, streaming", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


START_ORDERS = {
    "together": "both launched at once",
    "after-kv": "vLLM's server launched, Ray started, our app deployed once that server's engine allocates its "
                "KV cache: vLLM sizes its KV cache from the GPU's free memory, so two engines profiling at once "
                "would count each other's memory",
    "serial": "vLLM's server ready first, then our service"}


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # the `finally`s run: partial document, servers stopped


def main(argv=None) -> int:
    global SIDES  # --sides: the module's functions read it
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help=f"fast check: {SMOKE}")
    p.add_argument("--rounds", type=int, default=None, help="rounds (the first a warm-up); default 4, smoke 2")
    p.add_argument("--requests", type=int, default=None, help="requests per pass; default 160, smoke 32")
    p.add_argument("--shape", default=None, help="model shape (default tiny on CPU, qwen2.5-1.5b on a GPU)")
    p.add_argument("--work", default=None, help="model, adapter and logs (default: a temp dir)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--sides", default="front",
                   help="our sides, each measured against vLLM's server: front (the REST front, rollout.front_port: "
                        "the endpoint `app serve` prints by default), rest (Serve's own port), direct (the replica's "
                        "own port); default %(default)s")
    p.add_argument("--direct-ingress", action="store_true",
                   help="Ray Serve's experimental direct ingress: the Ingress replica serves HTTP itself, no proxy hop")
    p.add_argument("--start-order", choices=list(START_ORDERS), default=None,
                   help="how the two servers start: " + "; ".join(f"{k}: {v}" for k, v in START_ORDERS.items())
                   + " (default after-kv on a GPU, together on CPU)")
    p.add_argument("--finish", metavar="PARTIAL", default=None,
                   help="write the final document (in PARTIAL's folder) from a partial one whose run did every pass "
                        "but was stopped before its document; runs nothing")
    args = p.parse_args(argv)
    if args.finish:
        try:
            finish_partial(Path(args.finish))
        except (OSError, ValueError, KeyError) as e:
            p.error(f"--finish {args.finish}: {e}")
        return 0
    ours = [x.strip() for x in args.sides.split(",") if x.strip() and x.strip() != "vllm"]
    if not ours or set(ours) - set(PREFIX):
        p.error(f"--sides: choose from {', '.join(PREFIX)}, got {args.sides!r}")
    SIDES = (*ours, "vllm")
    w = WORKLOAD
    if args.smoke:
        w.update(SMOKE)
    w["rounds"] = args.rounds or w["rounds"]
    w["requests"] = args.requests or w["requests"]
    gpus = min(1, _gpus())
    device = "gpu" if gpus else "cpu"
    out, work = Path(args.out), Path(args.work or tempfile.mkdtemp(prefix="rest-vs-vllm-"))
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    t_start, load_at_start, code = time.time(), list(os.getloadavg()), code_state()

    from app.tiny_model import ensure_model
    from common.adapter_io import write_peft_dir

    shape = args.shape or ("qwen2.5-1.5b" if gpus else "tiny")
    model = ensure_model(work / f"{shape}-model", shape=shape)
    tensors, meta = make_lora_payload(model, seed=1, rank=w["lora_rank"])
    adapter = write_peft_dir(tensors, meta["peft_config"], work / "adapter")
    cfg = service_config(model, gpus)
    # after-kv on a GPU: two engines must not profile the GPU's free memory at once. (The H200 failures of
    # 2026-12-04 blamed on it were the registry's death: start_rest let its handle go.) serial costs ~100 s.
    start_order = args.start_order or ("after-kv" if gpus else "together")
    passes = w["rounds"] * len(ENDPOINTS) * len(SIDES)
    progress = Progress(out / f"rest_vs_vllm_{device}_partial.json", {
        "command": "python -m benchmarks.rest_vs_vllm " + " ".join(argv), "workload": {**w, "shape": shape},
        "code": code, "work_dir": str(work), "load_avg_1_5_15_min_at_start": load_at_start},
        passes)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    progress.stage(f"model {shape} and a random rank-{w['lora_rank']} adapter in {work}; starting vLLM's "
                   f"api_server and our service (--start-order {start_order}) ...")
    starts = progress.starts
    starts["start_order"] = start_order
    rounds = progress.rounds
    server = front_watch = None
    try:
        server = VllmServer.for_engine(cfg, adapter, work / "vllm_server.log", on_event=progress.stage,
                                       log_kv=start_order == "after-kv")
        progress.base.update(vllm_server_cmd=server.cmd, vllm_server_env_extra=server.env_extra,
                             vllm_server_log=str(server.log_path))
        progress.stage(f"vLLM api_server launched (pid {server.proc.pid}, :{server.port}); starting our service: "
                       "Ray ...")
        t0 = time.time()
        gate = {"together": None, "after-kv": server.wait_kv, "serial": server.wait_ready}[start_order]

        def before_deploy():
            if gate is not None:
                t = time.time()
                progress.stage("our service: Ray up; waiting for vLLM's api_server "
                               + ("to allocate its KV cache" if gate == server.wait_kv else "to be ready"))
                gate()
                starts["rest_waited_for_vllm_s"] = time.time() - t

        def rest_progress(msg: str):
            progress.stage(msg)
            if server.error is not None:  # no use waiting on ours (wait_healthy says why every ~30 s)
                raise server.error

        ports, held = start_rest(cfg, (tensors, meta), before_deploy=before_deploy, progress=rest_progress,
                                 direct_ingress=args.direct_ingress, front="front" in SIDES)  # held until main returns
        front_watch = held[1]
        front_pid = front_watch.front._proc.pid if front_watch else None
        if "front" in SIDES and front_watch is None:
            SIDES = tuple(x for x in SIDES if x != "front")
            passes = progress.passes = w["rounds"] * len(ENDPOINTS) * len(SIDES)
        starts["rest_s"] = time.time() - t0
        ports["vllm"] = server.port
        progress.stage(f"REST service healthy on :{ports['rest']} ({starts['rest_s']:.0f}s after launch); "
                       f"replica port :{ports['direct']}" + (f", front :{ports['front']}" if "front" in ports else "")
                       + ("" if server.ready_s else "; waiting for vLLM's api_server"))
        server.wait_ready()
        starts["vllm_s"] = server.ready_s
        starts["both_ready_s"] = time.time() - t0
        progress.stage(f"both ready ({starts['both_ready_s']:.0f}s: vLLM {starts['vllm_s']:.0f}s, REST "
                       f"{starts['rest_s']:.0f}s); {w['rounds']} rounds x {len(ENDPOINTS)} endpoints x "
                       f"{len(SIDES)} sides, {w['requests']} requests each")
        probes = starts["probes"] = {f"{side} {ep}": probe(ports[side], ep) for side in SIDES for ep in ENDPOINTS}
        bad = {k: v for k, v in probes.items() if v["status"] != 200}
        progress.stage("probe requests: " + ("every side answered 200" if not bad else "; ".join(
            f"{k}: {v['status']} {v['body'][:600]}" for k, v in bad.items())))
        if bad:
            log_service_errors()
        with open(work / "client.log", "w") as client_log:
            for r in range(w["rounds"]):
                order = SIDES if r % 2 == 0 else SIDES[::-1]
                row = {"order": list(order)}
                rounds.append(row)  # filled pass by pass: the partial document has the passes done so far
                for ep in ENDPOINTS:
                    row[ep] = {}
                    for side in order:
                        what = f"round {r + 1}/{w['rounds']}{' (warm-up)' if r == 0 else ''} {ep:<11} {side:<6}"
                        progress.stage(f"{what}: pass {progress.passes_done() + 1}/{passes} ...")
                        res = one_pass(side, ep, ports, server, model, w["requests"], seed=r, log_file=client_log,
                                       front_pid=front_pid)
                        row[ep][side] = res
                        progress.stage(f"{what}: {res['output_tok_s'] or 0:6.0f} tok/s, TTFT p50 "
                                       f"{res['ttft_p50_ms'] or 0:5.0f} ms, {res['completed']}/{w['requests']} ok")
                        if (why := all_failed(res)) is not None:  # no use running the other passes
                            log_service_errors()
                            raise RuntimeError(f"{what.strip()}: {why}")
        # The document before the servers stop: stopping Ray and Serve took over a minute on the H200, and a time
        # limit there once killed a run with every pass done and no document (finish_partial mends that case).
        from serve_deployments.engine_config import engine_kwargs

        settings = {"engine_kwargs": engine_kwargs(cfg), "engine_env": server.env, "vllm_server_cmd": server.cmd,
                    **({"vllm_server_env_extra": server.env_extra} if server.env_extra else {}),
                    "rest": {"replicas": 1, "router_policy": cfg.router.policy,
                             "ingress": ("Ray Serve direct ingress (the Ingress replica listens; no proxy)"
                                         if args.direct_ingress else "Ray Serve's HTTP proxy -> Ingress"),
                             "auth": "none: a standalone service's REST reads need no token (only /admin does)",
                             **({"stream_interval_ms": cfg.rollout.stream_interval_ms}
                                if hasattr(cfg.rollout, "stream_interval_ms") else {})},
                    "server_start_s": starts}
        doc = final_document(rounds, device, model, {
            "machine": machine(load_at_start), "code": code, "command": "python -m benchmarks.rest_vs_vllm "
            + " ".join(argv), "workload": {**w, "shape": shape}, "settings": settings,
            "wall_s": time.time() - t_start, "work_dir": str(work)})
        write_final(doc, out, device)
        progress.path.unlink(missing_ok=True)  # the final document has it all
    except BaseException as e:  # a signal's SystemExit and Ctrl-C too: the partial document says why it stopped
        progress.write(f"stopped after {progress.passes_done()} of {passes} passes: {type(e).__name__}: {e}",
                       vllm_server_log_tail=server.log_tail() if server else "")
        raise
    finally:
        import ray
        from ray import serve

        if server is not None:
            server.close()
        if front_watch is not None:
            front_watch.stop()
        if ray.is_initialized():
            with contextlib.suppress(Exception):
                serve.shutdown()
            ray.shutdown()
    return 0


def final_document(rounds: list[dict], device: str, model: Path, fields: dict) -> dict:
    """The goal keys (each side's lower endpoint ratio), the per-endpoint summary, the rounds and `fields`."""
    summary = summarize(rounds)
    key = f"rest_vs_vllm_serve_{device}"
    doc = {"goal": f">= {GOAL}"}
    for side in SIDES[:-1]:
        r = PREFIX[side] + "ratio"
        worst = min(ENDPOINTS, key=lambda ep: summary[ep][r] if summary[ep][r] is not None else -1)
        doc[key + SUFFIX[side]] = summary[worst][r]
        doc[key + SUFFIX[side] + "_is"] = (f"the lower of the completions and chat ratios ({worst}): "
                                           f"{SIDE_LABELS[side]} / vLLM output tok/s")
        doc["met" + SUFFIX[side]] = summary[worst][r] is not None and summary[worst][r] >= GOAL
    w = fields["workload"]
    doc |= {
        "endpoints": summary, "rounds": rounds,
        "method": f"both servers alive, passes interleaved A B B A over {w['rounds']} rounds (the first a warm-up), "
                  "one endpoint at a time; a ratio is the median over the measured rounds of REST / vLLM within "
                  "the round; one client seed per round (both sides get the same prompts)",
        **fields}
    doc.setdefault("settings", {})["client"] = "vllm bench serve " + " ".join(
        client_argv("completions", 0, model, w["requests"], 0))
    return doc


def write_final(doc: dict, out: Path, device: str) -> Path:
    """OUT/rest_vs_vllm_{device}.json, its plot, the table and the goal line."""
    f = out / f"rest_vs_vllm_{device}.json"
    f.write_text(json.dumps(doc, indent=2, default=_jsonable))
    try:
        plot(doc, f.with_suffix(".png"))
    except Exception as e:  # a missing matplotlib must not lose the numbers
        log(f"plot failed: {e}")
    print(table(doc["endpoints"]))
    key = f"rest_vs_vllm_serve_{device}"
    log(", ".join(f"{key}{SUFFIX[side]} = {_ratio_text(doc[key + SUFFIX[side]])}" for side in SIDES[:-1])
        + f" (goal >= {GOAL}); wrote {f} and {f.with_suffix('.png').name}")
    return f


def finish_partial(partial: Path) -> Path:
    """The final document from a partial one that a run left behind with every pass done (killed while its
    servers stopped): the same keys, from the same passes; the partial stays, as the record of the stop."""
    global SIDES
    doc = json.loads(partial.read_text())
    if not doc.get("rounds") or doc.get("passes_done") != doc.get("passes"):
        raise ValueError(f"{partial}: {doc.get('passes_done')} of {doc.get('passes')} passes were done; only a run "
                         "that finished every pass can be finished from its partial document")
    ours = [s for s in doc["rounds"][0]["order"] if s != "vllm"]
    SIDES = (*sorted(ours, key=list(PREFIX).index), "vllm")
    device = "gpu" if partial.name.endswith("_gpu_partial.json") else "cpu"
    fields = {k: doc[k] for k in ("code", "command", "workload", "work_dir", "load_avg_1_5_15_min_at_start",
                                  "wall_s") if k in doc}
    fields |= {"settings": {"vllm_server_cmd": doc.get("vllm_server_cmd"), "server_start_s": doc.get("server_start_s")},
               "finished_from_partial": {"file": partial.name, "reason": doc.get("partial_reason"),
                                         "updated_at": doc.get("updated_at")}}
    model = Path(doc.get("work_dir") or ".") / f"{doc['workload'].get('shape', 'tiny')}-model"
    return write_final(final_document(doc["rounds"], device, model, fields), partial.parent, device)

if __name__ == "__main__":
    sys.exit(main())
