"""The weight transports (serve_deployments/engine_weights.py) against a fake engine: no vLLM, no Ray.
Real payloads of the tiny model (the ones the trainer publishes), so verification is the real one."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from serve_deployments.adapter_files import BaseModelShapes
from serve_deployments.adapter_slots import AdapterSlots
from serve_deployments.engine_weights import AdapterTransport, MergedTransport, ReplicaError, payload_kind
from tests._serve_helpers import make_lora_payload, make_merged_payload


class FakeEngine:
    def __init__(self, fail_add: bool = False):
        self.loras: dict[int, str] = {}
        self.calls: list = []
        self.fail_add = fail_add

    async def add_lora(self, req):
        if self.fail_add:
            raise RuntimeError("engine says no")
        assert Path(req[2], "adapter_config.json").exists()  # a real PEFT dir is there when the engine loads it
        self.loras[req[1]] = req[2]

    async def remove_lora(self, int_id):
        self.loras.pop(int_id)

    async def collective_rpc(self, method, args=()):
        assert Path(args[0]).exists()
        self.calls.append(method)

    async def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def shapes(tiny_model_dir):
    return BaseModelShapes(str(tiny_model_dir))


def adapters(shapes, tmp_path, engine, capacity=2):
    return AdapterTransport(engine, AdapterSlots(capacity), shapes, tmp_path, max_rank=8,
                            lora_request=lambda name, int_id, path: (name, int_id, path))


def test_adapter_load_evict_and_refusals(tiny_model_dir, shapes, tmp_path):
    engine = FakeEngine()
    t = adapters(shapes, tmp_path, engine)
    payloads = {v: make_lora_payload(tiny_model_dir, seed=v) for v in (1, 2, 3)}
    assert payload_kind(payloads[1][1]) == "adapter"
    for v in (1, 2):
        assert run(t.load(v, *payloads[v]))["evicted"] is None
    assert sorted(engine.loras) == [1, 2] and set(t.requests) == {"policy-v1", "policy-v2"}
    t.slots.acquire(1)  # v1 busy: v2 is the one to go
    assert run(t.load(3, *payloads[3]))["evicted"] == "policy-v2"
    assert sorted(engine.loras) == [1, 3] and t.request(3)[0] == "policy-v3"
    assert not Path(t.slots.loaded[("", 1)]).name.startswith("policy-v2")
    t.slots.acquire(3)
    with pytest.raises(ReplicaError) as e:  # every slot busy
        run(t.load(2, *payloads[2]))
    assert e.value.status_code == 503
    t.slots.release(3)
    tensors, meta = payloads[2]
    bad = dict(tensors, **{next(iter(tensors)): next(iter(tensors.values())) + 1})
    with pytest.raises(ReplicaError) as e:  # corrupted in transit: the digest does not match
        run(t.load(2, bad, meta))
    assert e.value.status_code == 422 and sorted(engine.loras) == [1, 3]  # nothing changed
    with pytest.raises(ReplicaError, match="other weights"):  # a version name is never reused
        run(t.load(3, *payloads[2]))
    run(t.evict_all())
    assert engine.loras == {} and t.requests == {} and not list(tmp_path.iterdir())


def test_fleet_runs_named_ids_never_reused(tiny_model_dir, shapes, tmp_path):
    """Two runs' policy-v1 side by side: own names, own LoRA ids (the run "" keeps id = version), a run
    evicts only its own; forgetting a run frees its ids for good (a later run of that name gets new ones)."""
    from serve_deployments.engine_weights import FLEET_LORA_ID_START

    engine = FakeEngine()
    t = adapters(shapes, tmp_path, engine, capacity=4)
    t.slots.set_quota("", 1)
    t.slots.set_quota("a", 2)
    t.slots.set_quota("b", 1)
    p = {v: make_lora_payload(tiny_model_dir, seed=v) for v in (1, 2, 3)}
    run(t.load(1, *p[1]))
    run(t.load(1, *p[2], run="a"))
    run(t.load(1, *p[3], run="b"))
    assert set(t.requests) == {"policy-v1", "a/policy-v1", "b/policy-v1"}
    assert sorted(engine.loras) == [1, FLEET_LORA_ID_START, FLEET_LORA_ID_START + 1]
    assert t.request(1, "a") == ("a/policy-v1", FLEET_LORA_ID_START, t.slots.loaded[("a", 1)])
    assert Path(t.slots.loaded[("a", 1)]).parent == tmp_path  # a flat dir, not a/ under the scratch dir
    run(t.load(2, *p[1], run="a"))
    assert run(t.load(3, *p[2], run="a"))["evicted"] == "a/policy-v1"  # a's own oldest, never b's or ""'s
    assert t.slots.keys() == [("", 1), ("a", 2), ("a", 3), ("b", 1)]
    with pytest.raises(ReplicaError) as e:  # b has one slot, and it is busy
        t.slots.acquire(1, "b")
        run(t.load(2, *p[1], run="b"))
    assert e.value.status_code == 503 and "run b" in str(e.value)
    t.slots.release(1, "b")
    assert run(t.forget("a")) == [2, 3]
    assert t.slots.keys() == [("", 1), ("b", 1)] and set(t.requests) == {"policy-v1", "b/policy-v1"}
    t.slots.set_quota("a", 2)
    run(t.load(1, *p[3], run="a"))  # a new run "a": other weights under a/policy-v1 are fine, with a new id
    assert t.request(1, "a")[1] == FLEET_LORA_ID_START + 4 and sorted(engine.loras)[-1] == FLEET_LORA_ID_START + 4
    run(t.evict_all())
    assert engine.loras == {} and t.requests == {} and not list(tmp_path.iterdir())


def test_engine_refusal_leaves_no_dir(tiny_model_dir, shapes, tmp_path):
    t = adapters(shapes, tmp_path, FakeEngine(fail_add=True))
    with pytest.raises(ReplicaError) as e:
        run(t.load(1, *make_lora_payload(tiny_model_dir, seed=1)))
    assert e.value.status_code == 422 and not list(tmp_path.iterdir()) and not t.slots.loaded


def test_merged_stage_and_swap(tiny_model_dir, shapes, tmp_path):
    engine = FakeEngine()
    t = MergedTransport(engine, shapes, tmp_path)
    full, meta = make_merged_payload(tiny_model_dir, *make_lora_payload(tiny_model_dir, seed=5))
    assert payload_kind(meta) == "merged" and not t.holds(4, meta)
    run(t.swap(4, t.stage(4, full, meta), meta["sha256"]))
    assert engine.calls == ["load_merged_weights", "reset_prefix_cache"]
    assert (t.version, t.sha256) == (4, meta["sha256"])
    assert not list(tmp_path.iterdir())  # the staged file is gone
    assert t.holds(5, meta)  # a tagged version: same digest, nothing to load
    t.tag(5)
    assert t.version == 5
    partial = dict(list(full.items())[:3])
    with pytest.raises(ReplicaError) as e:
        t.stage(6, partial, meta)
    assert e.value.status_code == 422
    with pytest.raises(ReplicaError, match="not merged"):  # an adapter payload is not merged weights
        t.stage(6, *make_lora_payload(tiny_model_dir, seed=6))
