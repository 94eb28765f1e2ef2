"""The Serve behaviour the routing path relies on (serve_deployments/replica_calls.py), on real Ray Serve
with dummy deployments (no engine, seconds). A Ray upgrade that changes it fails here, loudly:

- `choose_replica(route=ticket)` runs the deployment's PolicyRouter with the ticket, `dispatch` sends
  only the call's own arguments, and the call lands on the replica the policy chose;
- the n concurrent calls of one ingress request, each started in a fresh context, all complete on the
  replica their ticket chose (a GRPO group: one replica, its cache);
- without the fresh context they share Serve's internal request id and never get a replica. If this
  test starts failing because they do, Serve fixed it: drop `_in_fresh_context` from replica_calls.py.

And the project uses no private Serve API (the issue-12 rule), checked by reading the sources.
"""
from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
APP = "serve-contract"


@pytest.fixture(scope="module")
def fan():
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"port": 0})

    @serve.deployment(num_replicas=2, max_ongoing_requests=32, ray_actor_options={"num_cpus": 0.1},
                      request_router_config=RequestRouterConfig(
                          request_router_class="serve_deployments.request_router:PolicyRouter"))
    class Echo:
        async def who(self, x, **kwargs):
            await asyncio.sleep(0.05)
            return {"replica": serve.get_replica_context().replica_id.unique_id, "x": x, "kwargs": kwargs}

    # router.policy serve_default: the same calls, Serve's own router, no ticket.
    Plain = serve.deployment(Echo.func_or_class, name="Plain", num_replicas=2, max_ongoing_requests=32,
                             ray_actor_options={"num_cpus": 0.1})

    @serve.deployment(ray_actor_options={"num_cpus": 0.1})
    class Fan:
        def __init__(self, echo, plain):
            from serve_deployments.request_router import RoutingPolicy

            self.echo, self.plain, self.policy = echo, plain, RoutingPolicy()

        async def untracked(self, n: int) -> list:
            from serve_deployments.replica_calls import call_replica

            return list(await asyncio.gather(*[call_replica(self.plain, "who", i) for i in range(n)]))

        async def group(self, n: int, tokens: list[int]) -> dict:
            from serve_deployments.prefix_hash import route_key
            from serve_deployments.replica_calls import call_replica
            from serve_deployments.request_router import RouteTicket

            key = route_key(tokens, 4)
            outs = await asyncio.gather(*[call_replica(self.echo, "who", i, ticket=RouteTicket(self.policy, key))
                                          for i in range(n)])
            with self.policy.lock:
                return {"outs": outs, "router": self.policy.snapshot()}

        async def shared_id(self, n: int, timeout_s: float) -> int:
            """n concurrent choose_replica calls in this request's own context: how many got a replica."""
            async def one(i):
                async with self.echo.options(method_name="who").choose_replica() as sel:
                    return await self.echo.dispatch(sel, i)

            tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
            done, pending = await asyncio.wait(tasks, timeout=timeout_s)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            return sum(1 for t in done if t.exception() is None)

    handle = serve.run(Fan.bind(Echo.bind(), Plain.bind()), name=APP, route_prefix=None)
    try:
        yield handle
    finally:
        serve.shutdown()
        ray.shutdown()


def test_group_of_routed_calls_lands_on_the_chosen_replica(fan):
    first = fan.group.remote(8, list(range(16))).result(timeout_s=60)
    outs, router = first["outs"], first["router"]
    assert sorted(o["x"] for o in outs) == list(range(8))
    assert all(o["kwargs"] == {} for o in outs)  # the ticket went to the router, not to the replica
    assert len({o["replica"] for o in outs}) == 1
    assert router["requests"] == 8 and router["unmatched"] == 1 and router["affinity"] == 7
    assert len(router["replicas"]) == 2 and all(r["inflight"] == 0 for r in router["replicas"].values())
    # Another prompt: a new group, again on one replica (the least loaded: both are idle).
    second = fan.group.remote(4, list(range(100, 116))).result(timeout_s=60)
    assert len({o["replica"] for o in second["outs"]}) == 1


def test_calls_without_ticket_under_serves_own_router(fan):
    outs = fan.untracked.remote(6).result(timeout_s=60)
    assert sorted(o["x"] for o in outs) == list(range(6)) and all(o["kwargs"] == {} for o in outs)


def test_calls_sharing_a_request_id_get_no_replica(fan):
    """Why replica_calls starts each call in a fresh context (see its docstring)."""
    served = fan.shared_id.remote(4, 5.0).result(timeout_s=60)
    assert served < 4, ("Serve now routes concurrent calls of one request (shared internal request id): "
                        "replica_calls._in_fresh_context is no longer needed")


def test_no_private_serve_api_in_the_project():
    private = re.compile(r"ray\.serve\._private|from ray\.serve[\w.]* import .*\b_\w|_fulfill_next_pending_request|"
                         r"_pending_requests|pending_request\._|selection\._|self\._deployment_id")
    hits = []
    for d in ("serve_deployments", "app", "common", "train_loops", "benchmarks"):
        for p in sorted((REPO / d).rglob("*.py")):
            for i, line in enumerate(p.read_text().splitlines(), 1):
                if private.search(line):
                    hits.append(f"{p.relative_to(REPO)}:{i}: {line.strip()}")
    assert not hits, "private Serve API in use:\n" + "\n".join(hits)
