"""The ingress's admin routes, /health and stats (serve_deployments/admin.py), tested apart from Serve and
vLLM: requests are real Starlette requests, the replicas and the registry are fakes (tests/_ingress_fakes.py).
The same routes against real replicas: tests/test_router_serve.py and tests/test_hostile_rest.py."""
from __future__ import annotations

import asyncio
import json

import pytest
import ray.exceptions as rex

from serve_deployments.admin import AdminRoutes, ServiceStatus, parse_version
from serve_deployments.admission import Admission
from serve_deployments.engine_weights import ReplicaError
from serve_deployments.openai_body import APIError
from serve_deployments.replica_broadcast import WeightsBroadcaster
from serve_deployments.replica_pool import ReplicaPool
from tests._ingress_fakes import ENGINE, FakePool, FakeReplica, FakeReplicaHandle, make_request, served_versions

TOKEN = "admin-test-token"


def admin(token: str | None = TOKEN, held=(3,), live=(3,)):
    replicas = [FakeReplica("r0", set(held)), FakeReplica("r1", set(held))]
    versions = served_versions(list(live))
    weights = WeightsBroadcaster(ReplicaPool(FakeReplicaHandle(replicas), None), versions)
    return AdminRoutes(token, versions, weights), replicas, versions


def request(path: str = "/admin/stats", method: str = "GET", token: str | None = TOKEN):
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return make_request([b""], headers, path=path, method=method)


def body(response) -> dict:
    return json.loads(response.body)


async def ok_action() -> dict:
    return {"done": True}


def test_token_is_checked_first():
    routes, _, _ = admin()
    assert asyncio.run(routes.run(request(token=None), ok_action)).status_code == 401
    wrong = asyncio.run(routes.run(request(token="wrong"), ok_action))
    assert wrong.status_code == 401 and body(wrong)["error"]["type"] == "authentication_error"
    right = asyncio.run(routes.run(request(), ok_action))
    assert right.status_code == 200 and body(right) == {"done": True}
    disabled, _, _ = admin(token=None)
    off = asyncio.run(disabled.run(request(), ok_action))
    assert off.status_code == 403 and "admin disabled" in body(off)["error"]["message"]


def test_failures_become_error_bodies():
    routes, replicas, _ = admin()
    replicas[0].fail["load_adapter"] = ReplicaError("digest mismatch", 400)

    async def raises(error):
        raise error

    rejected = asyncio.run(routes.run(request(), lambda: routes.load(3)))
    assert rejected.status_code == 422 and body(rejected)["error"]["type"] == "adapter_rejected"
    bad = asyncio.run(routes.run(request(), lambda: raises(APIError(400, "no", param="version"))))
    assert bad.status_code == 400 and body(bad)["error"]["param"] == "version"
    broken = asyncio.run(routes.run(request(), lambda: raises(KeyError("x"))))
    assert broken.status_code == 500 and body(broken)["error"]["message"] == "KeyError: 'x'"


def test_load_only_from_the_registry():
    routes, replicas, versions = admin(held=(), live=(3,))
    versions.unloaded.add(3)
    out = asyncio.run(routes.load(3))
    assert out["live"] is True and out["replicas"] == 2 and all(3 in r.versions for r in replicas)
    with pytest.raises(APIError) as e:
        asyncio.run(routes.load(9))
    assert e.value.status == 404 and "not held by the registry" in e.value.message


@pytest.mark.parametrize("text,version", [("3", 3), ("policy-v3", 3), ("0", None), ("policy-v0", None),
                                          ("abc", None), ("9" * 19, None), ("policy-latest", None), ("-1", None)])
def test_parse_version(text, version):
    if version is None:
        with pytest.raises(APIError) as e:
            parse_version(text)
        assert e.value.status == 400
    else:
        assert parse_version(text) == version


def test_unmatched_routes():
    routes, _, _ = admin()
    wrong_method = routes.unmatched(request("/v1/completions", "GET", token=None))
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    assert routes.unmatched(request("/nope", token=None)).status_code == 404
    assert routes.unmatched(request("/admin/nope", token=None)).status_code == 401  # a stranger learns nothing
    assert routes.unmatched(request("/admin/nope")).status_code == 404
    assert routes.unmatched(request("/admin/pause", "GET")).status_code == 405


def status(replicas: list[FakeReplica], live=(3,), num_replicas: int = 2, pool: FakePool | None = None):
    pool = pool or FakePool(replicas=replicas)
    versions = served_versions(list(live))
    return ServiceStatus(pool, versions, Admission(8), num_replicas), versions


def test_health_is_ready_only_when_every_replica_holds_every_live_version():
    ready, body_ = asyncio.run(status([FakeReplica("r0", {3}), FakeReplica("r1", {3})])[0].health())
    assert ready and body_["status"] == "ok" and body_["live"] == ["policy-v3"] and body_["replicas_ready"] == 2

    ready, body_ = asyncio.run(status([FakeReplica("r0", {3}), FakeReplica("r1", set())])[0].health())
    assert not ready and "not loaded" in body_["reason"] and body_["missing_versions"] == {"r1": ["policy-v3"]}

    ready, body_ = asyncio.run(status([FakeReplica("r0", {3})])[0].health())
    assert not ready and body_["reason"] == "1 of 2 replicas up"

    down = FakeReplica("r1", {3})
    down.fail["stats"] = rex.ActorDiedError()
    ready, body_ = asyncio.run(status([FakeReplica("r0", {3}), down])[0].health())
    assert not ready and body_["reason"] == "1 replicas did not answer"

    # Only the newest max_loras live versions must be held; merged versions are base weights.
    many = status([FakeReplica("r0", {4, 5}), FakeReplica("r1", {4, 5})], live=(3, 4, 5))[0]
    assert asyncio.run(many.health())[0] and ENGINE["max_loras"] == 2
    merged, versions = status([FakeReplica("r0", set()), FakeReplica("r1", set())], live=(3,))
    versions.merged_version = 3
    assert asyncio.run(merged.health())[0]


def test_health_while_the_replicas_are_unreachable():
    class NoEngine(FakePool):
        async def engine_info(self):
            raise rex.ActorDiedError()

    ready, body_ = asyncio.run(status([], pool=NoEngine())[0].health())
    assert not ready and body_["status"] == "starting" and "not reachable (ActorDiedError)" in body_["reason"]


def test_health_and_stats_when_the_handle_knows_no_replica():
    """After a Serve controller restart the replica handle may raise before any replica is asked (Serve's
    DeploymentUnavailableError, found by `bench chaos`): an error to report, not an exception out of /health."""
    from ray.serve.exceptions import DeploymentUnavailableError

    class NoReplicas(FakeReplicaHandle):
        def broadcast(self, method: str, *args):
            raise DeploymentUnavailableError("policy")

    pool = ReplicaPool(NoReplicas([]), None)
    pool._engine = dict(ENGINE)  # asked once at start, before the controller was lost
    service = ServiceStatus(pool, served_versions([3]), Admission(8), 2)
    ready, body_ = asyncio.run(service.health())
    assert not ready and body_["reason"] == "1 replicas did not answer"
    st = asyncio.run(service.stats())
    assert st["replicas"] == [] and len(st["replica_errors"]) == 1 and "policy" in st["replica_errors"][0]


def test_stats_gathers_router_admission_and_replicas():
    down = FakeReplica("r2")
    down.fail["stats"] = rex.ActorDiedError()
    service, versions = status([FakeReplica("r1", {3}), FakeReplica("r0", {3}), down], live=(3, 4))
    versions.unloaded.add(4)
    st = asyncio.run(service.stats())
    assert st["router"] == {"policy": "serve_default"} and [r["replica_id"] for r in st["replicas"]] == ["r0", "r1"]
    assert st["prefix_cache_hits"] == 2 and st["prefix_cache_queries"] == 4
    assert st["replica_errors"] == ["ActorDiedError: The actor died unexpectedly before finishing this task."]
    assert st["live_versions"] == [3] and st["merged_version"] == 0
    assert st["admission"] == {"inflight": 0, "max_inflight": 8, "rejected_429": 0, "rejected_413": 0,
                               "rejected_4xx": 0, "version_mismatches": 0, "replica_retries": 0}
