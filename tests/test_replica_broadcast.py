"""The ingress's weights broadcaster (serve_deployments/replica_broadcast.py) over the real ReplicaPool,
tested apart from Serve and vLLM: the replicas are fakes behind a fake DeploymentHandle's `broadcast`,
the registry is a fake too (tests/_ingress_fakes.py). All-or-nothing loads with rollback, and failures
caused by a lost replica raising a LostError that `is_lost` recognizes, also after Ray's wrapping and a
pickle round trip. The same protocol against real replicas: tests/test_router_serve.py."""
from __future__ import annotations

import asyncio
import pickle

import pytest
import ray.exceptions as rex

from common.faults import LostError, is_lost
from serve_deployments.engine_weights import ReplicaError
from serve_deployments.replica_broadcast import (
    AdapterLoadError,
    AdapterLoadLost,
    BroadcastError,
    BroadcastLost,
    WeightsBroadcaster,
)
from serve_deployments.replica_pool import ReplicaPool
from tests._ingress_fakes import FakeReplica, FakeReplicaHandle, served_versions


def broadcaster(held=(3,), live=(3,), meta: dict | None = None):
    replicas = [FakeReplica("r0", set(held)), FakeReplica("r1", set(held))]
    versions = served_versions(list(live), meta)
    weights = WeightsBroadcaster(ReplicaPool(FakeReplicaHandle(replicas), None), versions)
    return weights, replicas, versions


def test_load_reaches_every_replica():
    weights, replicas, versions = broadcaster()
    versions.unloaded.add(4)
    out = asyncio.run(weights.load_adapter(4))
    assert out["replicas"] == 2 and out["name"] == "policy-v4" and len(out["results"]) == 2
    assert all(r.versions == {3, 4} for r in replicas) and 4 not in versions.unloaded


def test_load_refused_by_one_replica_is_rolled_back_everywhere():
    weights, replicas, versions = broadcaster()
    replicas[1].fail["load_adapter"] = ReplicaError("policy-v4: digest mismatch", 400)
    with pytest.raises(AdapterLoadError, match=r"rejected by 1 of 2 replicas, rolled back: .*digest mismatch") as e:
        asyncio.run(weights.load_adapter(4))
    assert type(e.value) is AdapterLoadError and not is_lost(e.value)
    assert all(r.versions == {3} for r in replicas)  # r0 took it, then gave it back; v3 still served
    assert ("unload_adapter", 4) in replicas[0].calls


def test_failed_rollback_is_reported():
    weights, replicas, _ = broadcaster()
    replicas[0].fail["load_adapter"] = ReplicaError("bad shapes", 400)
    replicas[1].fail["unload_adapter"] = ReplicaError("busy", 409)
    with pytest.raises(AdapterLoadError, match=r"rollback failed on 1: ReplicaError: busy"):
        asyncio.run(weights.load_adapter(4))


@pytest.mark.parametrize("loss", [rex.ActorDiedError(), rex.ActorUnavailableError("unreachable", None)],
                         ids=["died", "unavailable"])
def test_load_that_lost_a_replica_raises_a_lost_error(loss):
    weights, replicas, _ = broadcaster()
    replicas[1].fail["load_adapter"] = loss
    with pytest.raises(AdapterLoadLost) as e:
        asyncio.run(weights.load_adapter(4))
    err = e.value
    assert isinstance(err, AdapterLoadError) and isinstance(err, LostError) and is_lost(err)
    assert replicas[0].versions == {3}  # rolled back on the replica that took it
    # What the registry receives: through pickle, and wrapped by Ray the way a handle call raises it.
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is AdapterLoadLost and str(again) == str(err) and is_lost(again)
    wrapped = rex.RayTaskError("load_adapter", "Traceback ...", err)
    assert is_lost(wrapped) and is_lost(wrapped.as_instanceof_cause())
    assert is_lost(pickle.loads(pickle.dumps(wrapped)))


def test_refusal_beside_a_loss_still_counts_as_lost():
    weights, replicas, _ = broadcaster()
    replicas[0].fail["load_adapter"] = ReplicaError("digest mismatch", 400)
    replicas[1].fail["load_adapter"] = rex.ActorDiedError()
    with pytest.raises(AdapterLoadLost, match="rejected by 2 of 2"):
        asyncio.run(weights.load_adapter(4))


def test_merged_payload_goes_to_update_weights():
    weights, replicas, versions = broadcaster(meta={5: {"sha256": "m5", "kind": "merged"}})
    out = asyncio.run(weights.load_adapter(5))
    assert out["replicas"] == 2 and versions.merged_version == 5
    assert all(("update_weights", 5) in r.calls and ("load_adapter", 5) not in r.calls for r in replicas)


def test_update_weights_failures():
    weights, replicas, versions = broadcaster()
    replicas[0].fail["update_weights"] = ReplicaError("shape mismatch", 400)
    with pytest.raises(BroadcastError, match="update_weights v5 failed on 1 of 2") as e:
        asyncio.run(weights.update_weights(5))
    assert not is_lost(e.value) and versions.merged_version == 0
    replicas[0].fail["update_weights"] = rex.ActorDiedError()
    with pytest.raises(BroadcastLost) as e:
        asyncio.run(weights.update_weights(5))
    assert is_lost(pickle.loads(pickle.dumps(e.value))) and versions.merged_version == 0


def test_unload_withholds_the_version():
    weights, replicas, versions = broadcaster(held=(3, 4), live=(3, 4))
    assert asyncio.run(weights.unload_adapter(4)) == {"version": 4, "name": "policy-v4", "replicas": 2}
    assert asyncio.run(versions.live()) == [3] and all(r.versions == {3} for r in replicas)
    asyncio.run(weights.load_adapter(4))
    assert asyncio.run(versions.live()) == [3, 4]


def test_pause_resume_and_expire():
    weights, replicas, _ = broadcaster()
    assert asyncio.run(weights.pause()) == {"paused": 2} and all(r.paused for r in replicas)
    assert asyncio.run(weights.resume()) == {"resumed": 2} and not any(r.paused for r in replicas)
    replicas[0].fail["pause"] = rex.ActorDiedError()
    with pytest.raises(BroadcastLost, match="pause failed on 1 replicas"):
        asyncio.run(weights.pause())
    replicas[1].fail["expire"] = RuntimeError("gone")  # best effort: no raise
    assert asyncio.run(weights.expire([1, 2])) == {"versions": [1, 2], "aborted": 2, "replicas": 1}


def test_broadcast_timeout_is_one_error():
    class Slow(FakeReplica):
        async def stats(self):
            await asyncio.sleep(5)

    pool = ReplicaPool(FakeReplicaHandle([Slow("r0")]), None)
    ok, errors = asyncio.run(pool.broadcast("stats", timeout_s=0.05))
    assert ok == [] and len(errors) == 1 and isinstance(errors[0], TimeoutError) and not is_lost(errors[0])
