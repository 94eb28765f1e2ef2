"""benchmarks/rest_vs_vllm.py's two servers: the one Config both engines come from, vLLM's own api_server in
a process group of its own (VllmServer: launched at once, watched for its KV cache and its /health), and our
service on Ray Serve (start_rest: the Serve port, the replica's own port and the REST front)."""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from app.tiny_model import serve_config
from benchmarks._rest_vs_vllm_common import REPO, WORKLOAD, _gpus, log
from common.ports import free_port


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
