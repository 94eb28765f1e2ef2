"""Prefix-aware routing: the decision (`RoutingPolicy`), the per-call request that carries it to Serve
(`RouteTicket`), and the Serve RequestRouter that asks it (`PolicyRouter`).

Who does what (docs/ARCHITECTURE.md, "Serving"):
- the ingress owns one `RoutingPolicy` (its state and counters: `Ingress.stats` reads them there);
- for each replica call it makes a `RouteTicket` (the policy, the prompt's route key from
  prefix_hash.route_key, a call id) and passes it to the public `DeploymentHandle.choose_replica(route=ticket)`;
  the call's own arguments go to `dispatch(selection, ...)`, so the replica never sees routing data;
- `PolicyRouter.choose_replicas` (the replica deployment's `request_router_config`, running inside the
  ingress's handle) reads the ticket from `pending_request.kwargs` and returns the policy's ranking;
- the ingress reports where the call went (`RouteTicket.routed`) and when it ended (`RouteTicket.done`).
Calls go through serve_deployments/replica_calls.py, which also says why each starts in a fresh context.

The decision:
- per replica, an LRU of the block hashes sent there (bounded by router.max_tracked_blocks);
- blocks every replica holds, or blocks followed by 2+ different next blocks (chat template, shared
  system prompt) identify no prompt: match only on the prompt-specific blocks past them
  (router.skip_generic; false = plain longest match from the first block);
- the replica with the longest match wins (round robin among ties), unless it has router.imbalance
  or more requests in flight than the least-loaded one: then spill there;
- no match: least loaded, round robin among ties; router.policy round_robin: round robin only;
- a key naming a `replica` (a multi-turn episode's session: the replica that served its previous turn,
  whose KV cache holds the whole conversation so far) goes there while that replica is a candidate;
- counters: affinity / spill / unmatched requests, and the cache-hit blocks this predicts.
"""
from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from ray.serve.request_router import RequestRouter

from common.config import ROUTING_POLICIES
from serve_deployments.replica_calls import ROUTE_KWARG

_MANY = -1  # in `_children`: this block was followed by 2+ different blocks


@dataclass
class Decision:
    replica: Hashable
    kind: str  # affinity | spill | unmatched | round_robin | session
    matched: int  # prompt-specific blocks the chosen replica holds
    predicted_hit_blocks: int  # blocks from the start the chosen replica holds (capped like vLLM)


class RoutingPolicy:
    """Routing state and decision (router.policy prefix or round_robin), free of Ray: unit-tested and
    benchmarked directly.

    Replica ids are any hashables; `ranked()` orders them by id so round robin is deterministic.
    Block ownership is a bitmask per hash (one bit per replica slot): "held by every replica" is a
    popcount and the longest match is a running AND, so a decision costs O(blocks), not
    O(blocks x replicas).
    """

    COUNTERS = ("requests", "affinity", "spill", "unmatched", "round_robin", "session", "predicted_hit_blocks",
                "cacheable_blocks", "generic_blocks", "rerouted")

    def __init__(self, policy: str = "prefix", imbalance: int = 8, max_tracked_blocks: int = 100_000,
                 skip_generic: bool = True):
        if policy not in ROUTING_POLICIES or policy == "serve_default":  # serve_default: Serve's router, not this
            raise ValueError(f"RoutingPolicy: policy {policy!r} is not prefix or round_robin")
        self.policy = policy
        self.imbalance = imbalance
        self.max_tracked_blocks = max_tracked_blocks
        self.skip_generic = skip_generic  # False: plain longest match from the first block (for comparison)
        self._slot: dict[Hashable, int] = {}  # replica -> bit index
        self._lru: dict[Hashable, OrderedDict] = {}  # replica -> block hashes sent there, oldest first
        self._owners: dict[int, int] = {}  # block hash -> bitmask of replicas holding it
        self._children: OrderedDict[int, int] = OrderedDict()  # block hash -> next block hash or _MANY
        # replica -> {request id: its weight (sequences: a rollout group counts its n samples)}, not completed
        self._inflight: dict[Hashable, dict] = {}
        self._assigned: dict[str, tuple[Hashable, Decision]] = {}  # request id -> (replica, decision)
        self._order: list[Hashable] = []  # replicas by id: the round-robin order
        self._pos: dict[Hashable, int] = {}
        self._rr = 0
        self.counters = dict.fromkeys(self.COUNTERS, 0)
        # Taken by RouteTicket, not here: tickets call in from Serve's router thread and the ingress's loop.
        self.lock = threading.Lock()

    # ------------------------------------------------------------ replica set

    def set_replicas(self, replicas: Sequence[Hashable]) -> None:
        new = set(replicas)
        for r in [r for r in self._slot if r not in new]:
            self.remove_replica(r)
        for r in sorted(new - set(self._slot), key=str):
            used = set(self._slot.values())
            self._slot[r] = next(i for i in range(len(used) + 1) if i not in used)
            self._lru[r] = OrderedDict()
            self._inflight[r] = {}
        self._order = sorted(self._slot, key=str)
        self._pos = {r: i for i, r in enumerate(self._order)}

    def remove_replica(self, replica: Hashable) -> None:
        """Forget a replica that left: its blocks, its bit in every owner mask, its in-flight set."""
        if replica not in self._slot:
            return
        clear = ~(1 << self._slot.pop(replica))
        for h in self._lru.pop(replica):
            mask = self._owners.get(h, 0) & clear
            if mask:
                self._owners[h] = mask
            else:
                self._owners.pop(h, None)
        for rid in self._inflight.pop(replica, ()):
            self._assigned.pop(rid, None)
        self._order = sorted(self._slot, key=str)
        self._pos = {r: i for i, r in enumerate(self._order)}

    def knows(self, replica: Hashable) -> bool:
        return replica in self._slot

    @property
    def replicas(self) -> list:
        return list(self._order)

    def load(self, replica: Hashable) -> int:
        return sum(self._inflight.get(replica, {}).values())

    def tracked_blocks(self, replica: Hashable) -> int:
        return len(self._lru.get(replica, ()))

    # ------------------------------------------------------------ decision

    def choose(self, key: dict | None, request_id: str | None = None,
               candidates: Sequence[Hashable] | None = None, weight: int = 1) -> Decision:
        """Pick a replica for a request with route key `key` (None: no prompt, load only) and record
        the choice (blocks + in flight) at once, so the next request of a burst already sees it. `weight`:
        the sequences the request runs (its share of a replica's load)."""
        if candidates is None or (len(candidates) == len(self._order) and all(r in self._slot for r in candidates)):
            cands = self._order  # the usual case: every replica is a candidate
        else:
            cands = sorted((r for r in candidates if r in self._slot), key=self._pos.__getitem__)
        if not cands:
            raise RuntimeError("RoutingPolicy.choose: no replicas")
        prev = self._assigned.get(request_id) if request_id is not None else None
        if prev is not None and prev[0] in cands:
            return prev[1]  # Serve retrying the same request: keep the decision (and its counts)
        hashes = (key or {}).get("hashes") or []
        hit_cap = (key or {}).get("hit_cap", len(hashes))
        loads = {r: self.load(r) for r in cands}
        session = (key or {}).get("replica")
        if session is not None and session in loads:
            d = Decision(session, "session", 0, 0)
        elif self.policy == "round_robin":
            d = self._decide_round_robin(cands, hashes)
        else:
            d = self._decide_prefix(cands, hashes, loads)
        d.predicted_hit_blocks = min(self._held_from_start(d.replica, hashes), hit_cap)
        self._record(d.replica, hashes)
        self._assign(request_id, d, hit_cap, weight)
        return d

    def ranked(self, chosen: Hashable, candidates: Sequence[Hashable] | None = None) -> list[list]:
        """Serve's ranked form: the choice first, then the rest by load (used only if it is full)."""
        rest = [r for r in (candidates if candidates is not None else self._order) if r != chosen]
        return [[chosen], sorted(rest, key=lambda r: (self.load(r), str(r)))] if rest else [[chosen]]

    def _decide_prefix(self, cands, hashes, loads) -> Decision:
        n_all = len(self._slot)
        all_mask = sum(1 << self._slot[r] for r in cands)
        cut = 0
        for i, h in enumerate(hashes if self.skip_generic else ()):
            mask = self._owners.get(h)
            if mask is None:
                break  # chained: nothing past an unseen block was seen either
            if (n_all > 1 and mask.bit_count() >= n_all) or self._children.get(h) == _MANY:
                cut = i + 1
        self.counters["generic_blocks"] += cut
        # Longest run of prompt-specific blocks from `cut`, as a running AND of owner masks.
        alive, matched = all_mask, 0
        for h in hashes[cut:]:
            nxt = alive & self._owners.get(h, 0)
            if not nxt:
                break
            alive, matched = nxt, matched + 1
        least = min(loads.values())
        if matched == 0:
            return Decision(self._rr_pick([r for r in cands if loads[r] == least]), "unmatched", 0, 0)
        best = [r for r in cands if alive >> self._slot[r] & 1]
        best_load = min(loads[r] for r in best)
        owner = self._rr_pick([r for r in best if loads[r] == best_load])
        if best_load - least >= self.imbalance:
            return Decision(self._rr_pick([r for r in cands if loads[r] == least]), "spill", 0, 0)
        return Decision(owner, "affinity", matched, 0)

    def _decide_round_robin(self, cands, hashes) -> Decision:
        r = self._rr_pick(cands)
        return Decision(r, "round_robin", 0, 0)

    def _rr_pick(self, tied: list) -> Hashable:
        self._rr += 1
        return tied[self._rr % len(tied)]

    def _held_from_start(self, replica, hashes) -> int:
        bit = 1 << self._slot[replica]
        n = 0
        for h in hashes:
            if not self._owners.get(h, 0) & bit:
                break
            n += 1
        return n

    def _record(self, replica, hashes) -> None:
        lru, bit = self._lru[replica], 1 << self._slot[replica]
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                self._owners[h] = self._owners.get(h, 0) | bit
        while len(lru) > self.max_tracked_blocks:
            old, _ = lru.popitem(last=False)
            mask = self._owners.get(old, 0) & ~bit
            if mask:
                self._owners[old] = mask
            else:
                self._owners.pop(old, None)
        ch = self._children
        for parent, child in zip(hashes, hashes[1:]):
            seen = ch.get(parent)
            if seen is None:
                ch[parent] = child
            else:
                if seen != child and seen != _MANY:
                    ch[parent] = _MANY
                ch.move_to_end(parent)
        # The branch map is a hint: bound it like one replica's table.
        while len(ch) > self.max_tracked_blocks:
            ch.popitem(last=False)

    # ------------------------------------------------------------ in-flight accounting

    def _assign(self, request_id, d: Decision, hit_cap: int, weight: int = 1) -> None:
        """Count the decision per sequence: a call of `weight` sequences (a rollout group) is its first
        sample's decision plus weight - 1 samples beside it on the same replica, which find the whole
        cacheable prompt there (counted as affinity), as they did when each sample was a call of its own."""
        c = self.counters
        prev = self._assigned.get(request_id) if request_id is not None else None
        if prev is not None:  # re-chosen because its replica left: move it, count it once
            w0 = self._inflight.get(prev[0], {}).pop(request_id, 1)
            c[prev[1].kind] -= 1
            c["affinity"] -= w0 - 1
            c["predicted_hit_blocks"] -= prev[1].predicted_hit_blocks + (w0 - 1) * prev[2]
            c["cacheable_blocks"] -= w0 * prev[2]
            c["requests"] -= w0
        weight = max(1, int(weight))
        c["requests"] += weight
        c[d.kind] += 1
        c["affinity"] += weight - 1
        c["predicted_hit_blocks"] += d.predicted_hit_blocks + (weight - 1) * hit_cap
        c["cacheable_blocks"] += weight * hit_cap
        if request_id is not None:
            self._inflight[d.replica][request_id] = weight
            self._assigned[request_id] = (d.replica, d, hit_cap)

    def routed(self, request_id: str, replica: Hashable, key: dict | None) -> None:
        """Serve sent the request to `replica`; if that is not our choice (ours was full), move it."""
        prev = self._assigned.get(request_id)
        if (prev is not None and prev[0] == replica) or replica not in self._slot:
            return
        hashes = (key or {}).get("hashes") or []
        hit_cap = (key or {}).get("hit_cap", len(hashes))
        if prev is None:  # its decision was dropped meanwhile (its replica left): count it here
            prev = (replica, Decision(replica, "unmatched", 0, 0), hit_cap)
            self.counters["requests"] += 1
            self.counters["unmatched"] += 1
            self.counters["cacheable_blocks"] += hit_cap
        weight = self._inflight.get(prev[0], {}).pop(request_id, 1)
        d = Decision(replica, prev[1].kind, 0, min(self._held_from_start(replica, hashes), prev[2]))
        self.counters["predicted_hit_blocks"] += d.predicted_hit_blocks - prev[1].predicted_hit_blocks
        self.counters["rerouted"] += 1
        self._record(replica, hashes)
        self._inflight[replica][request_id] = weight
        self._assigned[request_id] = (replica, d, prev[2])

    def completed(self, request_id: str) -> None:
        prev = self._assigned.pop(request_id, None)
        if prev is not None and prev[0] in self._inflight:
            self._inflight[prev[0]].pop(request_id, None)

    def snapshot(self) -> dict:
        c = dict(self.counters)
        routed = max(1, c["requests"])
        c.update({
            "policy": self.policy,
            "affinity_rate": c["affinity"] / routed,
            "predicted_hit_rate": c["predicted_hit_blocks"] / max(1, c["cacheable_blocks"]),
            "replicas": {str(r): {"inflight": self.load(r), "tracked_blocks": self.tracked_blocks(r)}
                         for r in self._order},
        })
        return c


# ---------------------------------------------------------------- one call's routing request

FALLBACK_AFTER_TRIES = 3  # routing attempts (with Serve's backoff between) before other replicas are offered


class RouteTicket:
    """What `choose_replica(route=ticket)` hands to `PolicyRouter` for one replica call: the ingress's
    policy, the prompt's route key (None: load only) and an id of its own (Serve's request ids are
    shared by every call made while serving one request). Replica ids are Serve's `unique_id` strings."""

    __slots__ = ("policy", "key", "call", "tries", "weight")

    def __init__(self, policy: RoutingPolicy, key: dict | None, weight: int = 1):
        self.policy, self.key, self.call, self.tries, self.weight = policy, key, uuid.uuid4().hex, 0, int(weight)

    def rank(self, replica_ids: list[str]) -> list[list[str]]:
        """Serve asks (again on every retry): the policy's choice first, the rest by load. The first
        tries offer only the choice: a queue-length probe that is merely slow (a busy host) must not
        send a group member elsewhere; load is the policy's call (spill), Serve's fallback is for a
        replica that stays full."""
        self.tries += 1
        pol = self.policy
        with pol.lock:
            if set(replica_ids) != set(pol.replicas):  # Serve offers every replica it routes to
                pol.set_replicas(replica_ids)
            d = pol.choose(self.key, self.call, candidates=replica_ids, weight=self.weight)
            ranks = pol.ranked(d.replica, replica_ids)
        return ranks[:1] if self.tries <= FALLBACK_AFTER_TRIES else ranks

    def routed(self, replica_id: str) -> None:
        """Where Serve sent the call (another replica than the choice only when that one stayed full)."""
        with self.policy.lock:
            self.policy.routed(self.call, replica_id, self.key)

    def done(self) -> None:
        with self.policy.lock:
            self.policy.completed(self.call)


# ---------------------------------------------------------------- the Serve RequestRouter

class PolicyRouter(RequestRouter):
    """The replica deployment's request router: asks the call's RouteTicket, if it has one; a call
    without one (e.g. `engine_info`) may go to any replica, the least loaded by Serve's probes.

    Serve cloudpickles this class by value (RequestRouterConfig), so it refers to no class of this
    module (a by-value copy would fail isinstance): the ticket is duck-typed. No FIFOMixin: the replica
    chosen for a call must serve that call.
    """

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if pending_request is None:
            return [candidate_replicas]
        # Serve retries a choice whose replicas were all full or slow to answer their queue-length
        # probe; without this flag it retries at once, in a hot loop that starves the very probes it
        # waits for (Serve's locality and multiplex helpers set it the same way).
        pending_request.routing_context.should_backoff = True
        rank = getattr(pending_request.kwargs.get(ROUTE_KWARG), "rank", None)
        if rank is None or not candidate_replicas:
            return [candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        return [[by_id[i] for i in ids] for ids in rank(list(by_id))]
