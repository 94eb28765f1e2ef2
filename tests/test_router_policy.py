"""The routing decision (RoutingPolicy), pure and fast: no Ray, no engine."""
from __future__ import annotations

import itertools

import pytest

from serve_deployments.prefix_hash import route_key
from serve_deployments.request_router import RoutingPolicy

BS = 16
_ids = itertools.count()


def prompt(seed: int, n: int = 5 * BS) -> list[int]:
    return [(seed * 7919 + i * 31) % 509 for i in range(n)]


def send(pol: RoutingPolicy, tokens, adapter=None, done=True):
    rid = f"req-{next(_ids)}"
    d = pol.choose(route_key(tokens, BS, adapter), rid)
    if done:
        pol.completed(rid)
    return d, rid


def test_group_lands_on_one_replica_and_predicts_hits():
    pol = RoutingPolicy(imbalance=8)
    pol.set_replicas(["a", "b"])
    toks = prompt(1, 3 * BS + 5)
    ds = [pol.choose(route_key(toks, BS), f"g{i}") for i in range(8)]  # a burst, all in flight
    assert len({d.replica for d in ds}) == 1
    assert [d.kind for d in ds] == ["unmatched"] + ["affinity"] * 7
    assert ds[0].predicted_hit_blocks == 0 and all(d.predicted_hit_blocks == 3 for d in ds[1:])
    s = pol.snapshot()
    assert s["requests"] == 8 and s["affinity"] == 7 and s["predicted_hit_blocks"] == 21
    assert s["replicas"][ds[0].replica]["inflight"] == 8


def test_distinct_prompts_spread_and_return_home():
    pol = RoutingPolicy()
    pol.set_replicas(["a", "b", "c"])
    homes = {s: send(pol, prompt(s))[0].replica for s in range(6)}
    assert set(homes.values()) == {"a", "b", "c"}  # unmatched ties go round robin
    for s in range(6):
        d, _ = send(pol, prompt(s))
        assert d.replica == homes[s] and d.kind == "affinity"


def test_adapters_never_share():
    pol = RoutingPolicy()
    pol.set_replicas(["a", "b"])
    toks = prompt(3)
    first, _ = send(pol, toks, "policy-v1")
    d, _ = send(pol, toks, "policy-v2")
    assert d.kind == "unmatched" and d.predicted_hit_blocks == 0
    d, _ = send(pol, toks, "policy-v1")
    assert d.kind == "affinity" and d.replica == first.replica


def test_shared_system_prompt_identifies_no_prompt():
    """Prompts behind one 2-block system prompt: once the system prompt is seen followed by different
    blocks, a new prompt is unmatched (balanced), not glued to whoever first held the system prompt."""
    pol = RoutingPolicy()
    pol.set_replicas(["a", "b"])
    system = prompt(100, 2 * BS)
    first, _ = send(pol, system + prompt(1, 2 * BS))
    second, _ = send(pol, system + prompt(2, 2 * BS))
    assert second.kind == "affinity" and second.replica == first.replica  # system blocks not yet known shared
    # Now the system prompt's last block has two different successors: it is generic.
    homes = [send(pol, system + prompt(s, 2 * BS))[0] for s in range(3, 9)]
    assert all(d.kind == "unmatched" for d in homes)
    assert {d.replica for d in homes} == {"a", "b"}
    # And each prompt still finds its own replica through its specific blocks.
    for s, d in zip(range(3, 9), homes):
        again, _ = send(pol, system + prompt(s, 2 * BS))
        assert again.replica == d.replica and again.kind == "affinity" and again.matched == 2
        assert again.predicted_hit_blocks == 3  # 4 full blocks, the last one is recomputed by vLLM
    assert pol.snapshot()["generic_blocks"] > 0


def test_blocks_every_replica_holds_are_generic():
    pol = RoutingPolicy()
    pol.set_replicas(["a", "b"])
    common = prompt(7, 3 * BS)
    # Force the common prefix onto both replicas.
    pol.choose(route_key(common, BS), "x", candidates=["a"])
    pol.choose(route_key(common, BS), "y", candidates=["b"])
    d, _ = send(pol, common + prompt(8, 2 * BS))
    assert d.kind == "unmatched"


def test_spill_when_owner_is_overloaded():
    pol = RoutingPolicy(imbalance=3)
    pol.set_replicas(["a", "b"])
    toks = prompt(11)
    ds = [pol.choose(route_key(toks, BS), f"s{i}") for i in range(5)]
    owner = ds[0].replica
    # 1 unmatched + 2 affinity puts 3 in flight on the owner; the 4th sees 3 - 0 >= 3 and spills.
    assert [d.kind for d in ds[:4]] == ["unmatched", "affinity", "affinity", "spill"]
    assert ds[3].replica != owner
    for i in range(5):
        pol.completed(f"s{i}")
    assert pol.load("a") == pol.load("b") == 0


def test_lru_bound_and_eviction():
    pol = RoutingPolicy(max_tracked_blocks=4)
    pol.set_replicas(["a"])
    for s in range(5):
        send(pol, prompt(s, 3 * BS))
    assert pol.tracked_blocks("a") == 4
    d, _ = send(pol, prompt(0, 3 * BS))  # evicted long ago
    assert d.predicted_hit_blocks == 0


def test_replica_leaves():
    pol = RoutingPolicy()
    pol.set_replicas(["a", "b"])
    d, rid = send(pol, prompt(21), done=False)
    pol.set_replicas(["a", "b", "c"])
    pol.remove_replica(d.replica)
    assert d.replica not in pol.replicas
    pol.completed(rid)  # completion of a request on a gone replica is harmless
    d2, _ = send(pol, prompt(21))
    assert d2.replica != d.replica and d2.kind == "unmatched"
    with pytest.raises(RuntimeError):
        RoutingPolicy().choose(None, "r")


def test_retry_counted_once_and_reroute_moves_load():
    pol = RoutingPolicy()
    pol.set_replicas(["a", "b"])
    key = route_key(prompt(31), BS)
    d1 = pol.choose(key, "r1")
    assert pol.choose(key, "r1") == d1  # Serve re-runs choose_replicas on backoff: same decision
    assert pol.snapshot()["requests"] == 1
    other = "b" if d1.replica == "a" else "a"
    pol.routed("r1", other, key)  # our choice was full; Serve used the next rank
    assert pol.load(other) == 1 and pol.load(d1.replica) == 0 and pol.snapshot()["rerouted"] == 1
    assert pol.ranked("a") == [["a"], ["b"]]


def test_a_group_call_weighs_its_samples():
    """A rollout group is one call of n samples: the replica's load counts n, the spill rule sees it, and a
    reroute or completion moves or frees all n."""
    pol = RoutingPolicy(imbalance=8)
    pol.set_replicas(["a", "b"])
    home = route_key(prompt(41), BS)
    d1 = pol.choose(home, "g1", weight=8)
    assert pol.load(d1.replica) == 8 and pol.snapshot()["replicas"][d1.replica]["inflight"] == 8
    # Counted per sample, as 8 calls were: the first unmatched, 7 beside it finding the whole prompt.
    s, cacheable = pol.snapshot(), home["hit_cap"]
    assert (s["requests"], s["unmatched"], s["affinity"]) == (8, 1, 7)
    assert s["predicted_hit_blocks"] == 7 * cacheable and s["cacheable_blocks"] == 8 * cacheable
    # The same prompt again: its owner is 8 sequences busier than the other replica, so the group spills.
    d2 = pol.choose(home, "g2", weight=8)
    assert d2.kind == "spill" and d2.replica != d1.replica
    pol.routed("g2", d1.replica, home)  # Serve sent it to the first one after all: all 8 move
    assert pol.load(d1.replica) == 16 and pol.load(d2.replica) == 0
    pol.completed("g1")
    pol.completed("g2")
    assert pol.load("a") == pol.load("b") == 0


def test_round_robin_policy():
    pol = RoutingPolicy(policy="round_robin")
    pol.set_replicas(["a", "b"])
    reps = [send(pol, prompt(41))[0].replica for _ in range(4)]
    assert reps in (["a", "b", "a", "b"], ["b", "a", "b", "a"])
    with pytest.raises(ValueError):
        RoutingPolicy(policy="serve_default")  # Serve's own router, not ours


def test_policy_router_asks_the_ticket():
    """PolicyRouter (Serve's side) reads the RouteTicket from choose_replica's kwargs and returns the
    policy's ranking: the choice alone for the first tries, then the rest by load; calls without a
    ticket may go anywhere (Serve picks the least loaded). The ticket tracks the call by its own id."""
    import asyncio
    from types import SimpleNamespace

    from serve_deployments.request_router import FALLBACK_AFTER_TRIES, PolicyRouter, RouteTicket

    reps = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=u)) for u in ("b", "a")]
    pol = RoutingPolicy()
    ticket = RouteTicket(pol, route_key(prompt(51), BS))
    pr = SimpleNamespace(kwargs={"route": ticket}, routing_context=SimpleNamespace(should_backoff=False))
    choose = lambda p: asyncio.run(PolicyRouter.choose_replicas(None, reps, p))  # noqa: E731
    first = choose(pr)
    assert pr.routing_context.should_backoff and len(first) == 1 and len(first[0]) == 1
    chosen = first[0][0].replica_id.unique_id
    assert pol.replicas == ["a", "b"] and pol.load(chosen) == 1
    for _ in range(FALLBACK_AFTER_TRIES - 1):
        assert choose(pr) == first  # Serve retrying: same decision, counted once
    assert [len(rank) for rank in choose(pr)] == [1, 1]  # now the other replica too, as a fallback
    assert pol.snapshot()["requests"] == 1
    ticket.routed(chosen)
    ticket.done()
    assert pol.load(chosen) == 0
    bare = SimpleNamespace(kwargs={"route": None}, routing_context=SimpleNamespace(should_backoff=False))
    assert choose(bare) == [reps] and choose(None) == [reps]
    # A replica that left is dropped from the policy on the next choice.
    reps.pop()
    RouteTicket(pol, None).rank(["b"])
    assert pol.replicas == ["b"]


def test_plain_longest_match_glues_shared_prefix():
    """The comparison mode: without skipping generic blocks, new prompts behind a shared system prompt
    all follow whoever first held it (until the imbalance cap spills them)."""
    pol = RoutingPolicy(skip_generic=False)
    pol.set_replicas(["a", "b"])
    system = prompt(100, 2 * BS)
    first, _ = send(pol, system + prompt(1, 2 * BS))
    assert {send(pol, system + prompt(s, 2 * BS))[0].replica for s in range(2, 8)} == {first.replica}


def test_router_config_per_policy():
    from common.config import ROUTING_POLICIES, Config
    from serve_deployments.app_builder import router_config, routing_options

    cfg = Config()
    assert router_config(cfg).request_router_class.endswith(":PolicyRouter")
    assert routing_options(cfg) == {"policy": "prefix", "imbalance": 8, "max_tracked_blocks": 100_000,
                                    "skip_generic": True}
    cfg = cfg.replace(router={"policy": "round_robin", "skip_generic": False})
    assert routing_options(cfg)["policy"] == "round_robin" and not routing_options(cfg)["skip_generic"]
    RoutingPolicy(**routing_options(cfg))
    cfg = cfg.replace(router={"policy": "serve_default"})
    assert router_config(cfg) is None and routing_options(cfg) is None  # Serve's built-in router
    assert set(ROUTING_POLICIES) == {"prefix", "round_robin", "serve_default"}
