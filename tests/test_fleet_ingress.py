"""A fleet's ingress parts, apart from Serve and vLLM (docs/FLEET.md): each run's versions under its own names,
rollout groups admitted by the fair queue and counted per run, and admin routes where a run's token changes
only its own adapters. The registries, replicas and FleetState are fakes (tests/_ingress_fakes.py); the same
against real engines and runs: tests/test_fleet.py."""
from __future__ import annotations

import asyncio
import json

import pytest

from serve_deployments.admin import AdminRoutes, parse_adapter
from serve_deployments.admission import Admission
from serve_deployments.fair_queue import FairQueue
from serve_deployments.openai_api import ModelNameError, model_run, resolve_model, served_names
from serve_deployments.openai_body import APIError
from serve_deployments.openai_routes import OpenAIRoutes
from serve_deployments.replica_broadcast import WeightsBroadcaster
from serve_deployments.replica_pool import ReplicaPool
from serve_deployments.rollout_groups import RolloutGroups
from serve_deployments.served_versions import RunVersions, UnknownRunError
from tests._ingress_fakes import FakePool, FakeRegistry, FakeReplica, FakeReplicaHandle, make_request

ADMIN = "fleet-admin"
TOKENS = {"a": "token-a", "b": "token-b"}


def runs(live: dict[str, list[int]]) -> RunVersions:
    """A fleet's RunVersions: run "" is the base model only, every other run has a fake registry."""
    registries = {run: FakeRegistry(versions) for run, versions in live.items()}
    out = RunVersions(lambda run: registries.get(run) if run else None)
    for run in live:
        out.add(run)
    return out


class FakeAccess:
    """FleetAccess without FleetState: each run's token changes that run's adapters."""

    async def may_change(self, run: str, token: str | None) -> bool:
        return token == ADMIN or TOKENS.get(run) == token

    async def is_run_token(self, token: str | None) -> bool:
        return token in TOKENS.values()


def test_names_are_per_run():
    assert model_run("a/policy-v3") == "a" and model_run("policy-v3") == "" and model_run("../x/y") == ""
    assert resolve_model("a/policy-v3", [2, 3], 0, "/m/tiny", run="a") == 3
    assert resolve_model("a/policy-latest", [2, 3], 0, "/m/tiny", run="a") == 3
    for bad, status in (("a/policy-v9", 404), ("a/base", 404), ("b/policy-v3", 400)):
        with pytest.raises(ModelNameError) as e:
            resolve_model(bad, [2, 3], 0, "/m/tiny", run="a")
        assert e.value.status == status, bad
    assert served_names([2, 3], "/m/tiny", run="a") == ["a/policy-v2", "a/policy-v3", "a/policy-latest"]
    assert parse_adapter("a/policy-v3") == ("a", 3) and parse_adapter("policy-v3") == ("", 3)
    with pytest.raises(APIError):
        parse_adapter("a/b/policy-v3")


def test_run_versions_know_only_attached_runs():
    r = runs({"a": [1, 2]})
    assert asyncio.run(r.get("a").live()) == [1, 2]
    assert asyncio.run(r.get("").live()) == []  # a fleet's own run: the base model only
    with pytest.raises(UnknownRunError):
        r.get("b")
    r.add("gone")  # attached, but its registry is not (or no longer) there: no versions, no error
    assert asyncio.run(r.get("gone").live()) == []
    r.drop("a")
    with pytest.raises(UnknownRunError):
        r.get("a")


def test_models_lists_the_runs_left_when_one_leaves_mid_listing():
    """/v1/models awaits each run's registry in turn; a run forgotten meanwhile is left out, not a 500 (CI saw
    `UnknownRunError: run 'b'` there when a run's lease ran out while a client polled)."""
    r = runs({"a": [1], "b": [2]})

    class Leaving(FakeRegistry):  # run a's registry answers after run b has left the fleet
        async def _live_versions(self):
            r.drop("b")
            return [1]

    r._runs["a"]._registry = Leaving([1])
    front = OpenAIRoutes(FakePool(), r, Admission(4), None, 4096)
    ids = {m["id"] for m in json.loads(asyncio.run(front.models()).body)["data"]}
    assert {"a/policy-v1", "a/policy-latest"} <= ids and not any(i.startswith("b/") for i in ids), ids


def test_groups_carry_their_run_and_are_counted_per_run():
    fair = FairQueue(16)
    for run in ("", "a", "b"):
        fair.set_weight(run)
    sample = lambda v, run: {"version": v, "token_ids": [1, 2, 3], "run": run}  # noqa: E731
    pool = FakePool([[sample(2, "a"), sample(2, "a")], [sample(5, "b")], [sample(2, "a")]])
    front = RolloutGroups(pool, runs({"a": [1, 2], "b": [5]}), Admission(16), fair=fair)
    asyncio.run(front.generate_group([7, 8], 2, None, {"max_tokens": 3}, run="a"))
    asyncio.run(front.generate_group([7, 8], 1, None, {"max_tokens": 3}, run="b"))
    reqs = [args[0] for _, args, _ in pool.calls]
    assert [(r["run"], r["version"]) for r in reqs] == [("a", 2), ("b", 5)]  # a group is one call
    assert fair.tokens == {"a": 6, "b": 3} and fair.inflight == 0
    with pytest.raises(ValueError, match="not attached"):
        asyncio.run(front.generate_group([7, 8], 1, run="c"))
    with pytest.raises(ValueError, match="not live"):
        asyncio.run(front.generate_group([7, 8], 1, 5, run="a"))  # run b's version number is not run a's
    # rollout.partial: a turn whose version is not live (yet) in its run starts under its run's newest, never
    # another run's (a/policy-v3 being published: run b's live v5 is not a's)
    asyncio.run(front.generate_group([7, 8], 1, 3, run="a", partial="all"))
    assert (pool.calls[-1][1][0]["run"], pool.calls[-1][1][0]["version"]) == ("a", 2)


def _admin():
    replicas = [FakeReplica("r0"), FakeReplica("r1")]
    r = runs({"a": [1], "b": [1]})
    weights = WeightsBroadcaster(ReplicaPool(FakeReplicaHandle(replicas), None), r)
    return AdminRoutes(ADMIN, r, weights, FakeAccess()), replicas


def _delete(routes: AdminRoutes, name: str, token: str | None):
    headers = {"authorization": f"Bearer {token}"} if token else {}
    request = make_request([b""], headers, path=f"/admin/adapters/{name}", method="DELETE")
    return asyncio.run(routes.adapter(request, name, routes._weights.unload_adapter))


def test_a_runs_token_changes_only_its_own_adapters():
    routes, replicas = _admin()
    other = _delete(routes, "b/policy-v1", TOKENS["a"])
    assert other.status_code == 403 and "only its own run" in json.loads(other.body)["error"]["message"]
    assert _delete(routes, "b/policy-v1", None).status_code == 401
    assert _delete(routes, "b/policy-v1", "nobody").status_code == 401
    assert not any(call[0] == "unload_adapter" for rep in replicas for call in rep.calls)  # nothing reached a replica
    own = _delete(routes, "a/policy-v1", TOKENS["a"])
    assert own.status_code == 200 and json.loads(own.body)["name"] == "a/policy-v1"
    assert [c for c in replicas[0].calls if c[0] == "unload_adapter"] == [("unload_adapter", 1, "a")]
    assert _delete(routes, "b/policy-v1", ADMIN).status_code == 200  # the fleet's admin token may


def test_a_run_must_train_the_model_the_fleet_serves(tmp_path):
    from app.fleet import engine_mismatch
    from common import config as C

    model = tmp_path / "model"
    model.mkdir()
    cfg = C.load("recipes/tiny-cpu.yaml", [f"model.path={model}", "model.build_tiny=false"])
    fleet = {"fleet": "f", "model": str(model), "model_realpath": str(model.resolve()), "dtype": "float32",
             "fp32_head": False}
    assert engine_mismatch(cfg, fleet) is None
    assert "is not the model fleet f serves" in engine_mismatch(cfg, dict(fleet, model_realpath="/other/model"))
    assert "model.dtype float32 differs" in engine_mismatch(cfg, dict(fleet, dtype="bfloat16"))
    assert "model.fp32_head False differs" in engine_mismatch(cfg, dict(fleet, fp32_head=True))
