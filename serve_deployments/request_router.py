"""Prefix-aware routing: the pure decision (`PrefixPolicy`) and the Serve RequestRouter that runs it.

`PrefixAwareRouter` is attached to the rollout replica deployment (`request_router_config`) and so
runs inside every DeploymentHandle to it, i.e. inside the ingress. The ingress puts a route key
(prefix_hash.route_key: the prompt's chained block hashes, seeded by adapter) into each request's
kwargs; the router reads it from `pending_request.kwargs` and removes it before the request is sent.

The decision (DESIGN.md section 2, "Routing"):
- per replica, an LRU of the block hashes sent there (bounded by router.max_tracked_blocks);
- blocks every replica holds, or blocks followed by 2+ different next blocks (chat template, shared
  system prompt) identify no prompt: match only on the prompt-specific blocks past them;
- the replica with the longest match wins (round robin among ties), unless it has router.imbalance
  or more requests in flight than the least-loaded one: then spill there;
- no match: least loaded, round robin among ties;
- counters: affinity / spill / unmatched requests, and the cache-hit blocks this predicts.

Serve 2.60 facts this relies on (read in ray/serve/_private/router.py, request_router/):
- Serve cloudpickles the router class by value: shared state lives in this module, imported at run
  time (`shared_policy`), one policy per target deployment per process;
- every handle call made while serving one request shares that request's internal id, so the route
  key carries a per-call id, completion is tracked on the call's result, and a chosen replica is
  handed to the exact call it was chosen for (`_fulfill_next_pending_request`);
- `choose_replicas` must set `routing_context.should_backoff`, or Serve retries without sleeping.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from ray.serve.request_router import LocalityMixin, MultiplexMixin, RequestRouter

from serve_deployments.prefix_hash import ROUTE_KWARG

_MANY = -1  # in `_children`: this block was followed by 2+ different blocks
FALLBACK_AFTER_TRIES = 3  # routing attempts (with Serve's backoff between) before other replicas are offered


@dataclass
class Decision:
    replica: Hashable
    kind: str  # affinity | spill | unmatched | round_robin
    matched: int  # prompt-specific blocks the chosen replica holds
    predicted_hit_blocks: int  # blocks from the start the chosen replica holds (capped like vLLM)


class PrefixPolicy:
    """Routing state and decision, free of Ray (unit-tested and benchmarked directly).

    Replica ids are any hashables; `ranked()` orders them by id so round robin is deterministic.
    Block ownership is a bitmask per hash (one bit per replica slot): "held by every replica" is a
    popcount and the longest match is a running AND, so a decision costs O(blocks), not
    O(blocks x replicas).
    """

    COUNTERS = ("requests", "affinity", "spill", "unmatched", "round_robin", "predicted_hit_blocks",
                "cacheable_blocks", "generic_blocks", "rerouted")

    def __init__(self, policy: str = "prefix", imbalance: int = 8, max_tracked_blocks: int = 100_000,
                 skip_generic: bool = True):
        if policy not in ("prefix", "round_robin"):
            raise ValueError(f"PrefixPolicy: policy {policy!r} is not prefix or round_robin")
        self.policy = policy
        self.imbalance = imbalance
        self.max_tracked_blocks = max_tracked_blocks
        self.skip_generic = skip_generic  # False: plain longest match from the first block (for comparison)
        self._slot: dict[Hashable, int] = {}  # replica -> bit index
        self._lru: dict[Hashable, OrderedDict] = {}  # replica -> block hashes sent there, oldest first
        self._owners: dict[int, int] = {}  # block hash -> bitmask of replicas holding it
        self._children: OrderedDict[int, int] = OrderedDict()  # block hash -> next block hash or _MANY
        self._inflight: dict[Hashable, set] = {}  # replica -> request ids routed there, not completed
        self._assigned: dict[str, tuple[Hashable, Decision]] = {}  # request id -> (replica, decision)
        self._order: list[Hashable] = []  # replicas by id: the round-robin order
        self._pos: dict[Hashable, int] = {}
        self._rr = 0
        self.counters = dict.fromkeys(self.COUNTERS, 0)
        self.lock = threading.Lock()  # for callers on several threads (Serve routers); not taken here

    # ------------------------------------------------------------ replica set

    def set_replicas(self, replicas: Sequence[Hashable]) -> None:
        new = set(replicas)
        for r in [r for r in self._slot if r not in new]:
            self.remove_replica(r)
        for r in sorted(new - set(self._slot), key=str):
            used = set(self._slot.values())
            self._slot[r] = next(i for i in range(len(used) + 1) if i not in used)
            self._lru[r] = OrderedDict()
            self._inflight[r] = set()
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
        return len(self._inflight.get(replica, ()))

    def tracked_blocks(self, replica: Hashable) -> int:
        return len(self._lru.get(replica, ()))

    # ------------------------------------------------------------ decision

    def choose(self, key: dict | None, request_id: str | None = None,
               candidates: Sequence[Hashable] | None = None) -> Decision:
        """Pick a replica for a request with route key `key` (None: no prompt, load only) and record
        the choice (blocks + in flight) at once, so the next request of a burst already sees it."""
        if candidates is None or (len(candidates) == len(self._order) and all(r in self._slot for r in candidates)):
            cands = self._order  # the usual case: every replica is a candidate
        else:
            cands = sorted((r for r in candidates if r in self._slot), key=self._pos.__getitem__)
        if not cands:
            raise RuntimeError("PrefixPolicy.choose: no replicas")
        prev = self._assigned.get(request_id) if request_id is not None else None
        if prev is not None and prev[0] in cands:
            return prev[1]  # Serve retrying the same request: keep the decision (and its counts)
        hashes = (key or {}).get("hashes") or []
        hit_cap = (key or {}).get("hit_cap", len(hashes))
        loads = {r: len(self._inflight[r]) for r in cands}
        if self.policy == "round_robin":
            d = self._decide_round_robin(cands, hashes)
        else:
            d = self._decide_prefix(cands, hashes, loads)
        d.predicted_hit_blocks = min(self._held_from_start(d.replica, hashes), hit_cap)
        self._record(d.replica, hashes)
        self._assign(request_id, d, hit_cap)
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

    def _assign(self, request_id, d: Decision, hit_cap: int) -> None:
        c = self.counters
        prev = self._assigned.get(request_id) if request_id is not None else None
        if prev is not None:  # re-chosen because its replica left: move it, count it once
            self._inflight.get(prev[0], set()).discard(request_id)
            c[prev[1].kind] -= 1
            c["predicted_hit_blocks"] -= prev[1].predicted_hit_blocks
            c["cacheable_blocks"] -= prev[2]
            c["requests"] -= 1
        c["requests"] += 1
        c[d.kind] += 1
        c["predicted_hit_blocks"] += d.predicted_hit_blocks
        c["cacheable_blocks"] += hit_cap
        if request_id is not None:
            self._inflight[d.replica].add(request_id)
            self._assigned[request_id] = (d.replica, d, hit_cap)

    def routed(self, request_id: str, replica: Hashable, key: dict | None) -> None:
        """Serve sent the request to `replica`; if that is not our choice (ours was full), move it."""
        prev = self._assigned.get(request_id)
        if (prev is not None and prev[0] == replica) or replica not in self._slot:
            return
        hashes = (key or {}).get("hashes") or []
        hit_cap = (key or {}).get("hit_cap", len(hashes))
        if prev is None:  # Serve gave it a replica chosen for another call of the same request id
            prev = (replica, Decision(replica, "unmatched", 0, 0), hit_cap)
            self.counters["requests"] += 1
            self.counters["unmatched"] += 1
            self.counters["cacheable_blocks"] += hit_cap
        self._inflight.get(prev[0], set()).discard(request_id)
        d = Decision(replica, prev[1].kind, 0, min(self._held_from_start(replica, hashes), prev[2]))
        self.counters["predicted_hit_blocks"] += d.predicted_hit_blocks - prev[1].predicted_hit_blocks
        self.counters["rerouted"] += 1
        self._record(replica, hashes)
        self._inflight[replica].add(request_id)
        self._assigned[request_id] = (replica, d, prev[2])

    def completed(self, request_id: str) -> None:
        prev = self._assigned.pop(request_id, None)
        if prev is not None and prev[0] in self._inflight:
            self._inflight[prev[0]].discard(request_id)

    def snapshot(self) -> dict:
        c = dict(self.counters)
        routed = max(1, c["requests"])
        c.update({
            "policy": self.policy,
            "affinity_rate": c["affinity"] / routed,
            "predicted_hit_rate": c["predicted_hit_blocks"] / max(1, c["cacheable_blocks"]),
            "replicas": {str(getattr(r, "unique_id", r)): {"inflight": self.load(r),
                                                           "tracked_blocks": self.tracked_blocks(r)}
                         for r in self._order},
        })
        return c


# ---------------------------------------------------------------- the Serve RequestRouter

# One policy per target deployment per process, shared by every RequestRouter instance Serve makes
# for it here (one per handle; it may also build one twice in a race): they route to the same
# replicas, so they must agree on what each replica holds. The ingress reads counters from here.
_POLICIES: dict[tuple[str, str], PrefixPolicy] = {}
_POLICIES_LOCK = threading.Lock()


def shared_policy(app: str, deployment: str, **kwargs) -> PrefixPolicy:
    with _POLICIES_LOCK:
        pol = _POLICIES.get((app, deployment))
        if pol is None:
            pol = _POLICIES[(app, deployment)] = PrefixPolicy(**kwargs)
        return pol


def local_policy(app: str, deployment: str) -> PrefixPolicy | None:
    with _POLICIES_LOCK:
        return _POLICIES.get((app, deployment))


def _call_id(pending_request, key: dict | None) -> str | None:
    """Identity of one call: the ingress's per-call id, else Serve's internal request id (shared by
    all calls made while serving one request, so only good for calls made one at a time)."""
    if key is not None and "call" in key:
        return key["call"]
    return pending_request.metadata.internal_request_id if pending_request is not None else None


def route_key_of(pending_request) -> dict | None:
    """The request's route key. The router consumes it: it is taken out of the kwargs on first sight
    (and kept on the PendingRequest for retries), so replica methods never see routing metadata."""
    if pending_request is None:
        return None
    key = getattr(pending_request, "_route_key", None)
    if key is None and ROUTE_KWARG in pending_request.kwargs:
        key = pending_request.kwargs.pop(ROUTE_KWARG)
        pending_request._route_key = key
    return key if isinstance(key, dict) else None


class PrefixAwareRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Serve RequestRouter running `PrefixPolicy` (router.policy prefix or round_robin).

    No FIFOMixin on purpose: the replica chosen for a request must serve *that* request (Serve's
    default exact match on the internal request id), or affinity decisions land on other prompts.

    Serve cloudpickles this class *by value* (RequestRouterConfig registers its module for it), so
    module globals it touched would be copies: state and registration go through the module
    imported at run time instead.
    """

    def initialize_state(self, policy: str = "prefix", imbalance: int = 8,
                         max_tracked_blocks: int = 100_000, skip_generic: bool = True) -> None:
        from serve_deployments import request_router as impl

        self.policy = impl.shared_policy(self._deployment_id.app_name, self._deployment_id.name, policy=policy,
                                         imbalance=imbalance, max_tracked_blocks=max_tracked_blocks,
                                         skip_generic=skip_generic)

    def _policy(self) -> PrefixPolicy:
        if not hasattr(self, "policy"):  # called before initialize_state: defaults until then
            self.initialize_state()
        return self.policy

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if not candidate_replicas:
            return []
        if pending_request is not None:
            # Serve retries a choice whose replicas were all full or slow to answer their queue-length
            # probe; without this flag (set by its locality/multiplex helpers, which we do not use) it
            # retries at once, in a hot loop that starves the very probes it waits for.
            pending_request.routing_context.should_backoff = True
        policy = self._policy()
        by_id = {r.replica_id: r for r in candidate_replicas}
        key = route_key_of(pending_request)
        request_id = _call_id(pending_request, key)
        with policy.lock:
            if not all(policy.knows(r) for r in by_id):  # update_replicas normally keeps them in sync
                policy.set_replicas(list(self._replicas))
            d = policy.choose(key, request_id, candidates=list(by_id))
            ranks = policy.ranked(d.replica, list(by_id))
        if pending_request is not None:
            # The first tries offer only our choice: a queue-length probe that is merely slow (a busy
            # host) must not send a group member elsewhere. Load is the policy's call (spill); Serve's
            # fallback ranks are for a replica that stays full.
            tries = getattr(pending_request, "_route_tries", 0) + 1
            pending_request._route_tries = tries
            if tries <= FALLBACK_AFTER_TRIES:
                ranks = ranks[:1]
        return [[by_id[r] for r in rank] for rank in ranks]

    def _fulfill_next_pending_request(self, replica, request_metadata=None) -> None:
        """Hand the chosen replica to the call it was chosen for. Serve matches by internal request
        id, which every call made while serving one request shares: the 8 concurrent calls of a
        GRPO group would find no match after the first and route forever. The metadata object is
        per call, so match on it, then fall back to Serve's rule."""
        if request_metadata is not None:
            for pr in self._pending_requests_to_fulfill:
                if pr.metadata is request_metadata and not pr.future.done():
                    self._cancel_routing_task_for_pending_request(pr)
                    self._record_queue_wait_time(pr)
                    pr.future.set_result(replica)
                    self._remove_pending_request_from_indices(pr)
                    return
        super()._fulfill_next_pending_request(replica, request_metadata)

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        policy = self._policy()
        key = route_key_of(pending_request)
        call = _call_id(pending_request, key)
        with policy.lock:
            policy.routed(call, replica_id, key)
        if key is not None and "call" in key:
            # Completion by call id: on_request_completed only names the internal request id, which
            # every call made while serving one ingress request shares (a whole GRPO group).
            def done(_, policy=policy, call=call):
                with policy.lock:
                    policy.completed(call)

            result.add_done_callback(done)

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        policy = self._policy()
        with policy.lock:
            policy.completed(internal_request_id)  # calls without a call id; others: no-op

    def update_replicas(self, replicas) -> None:
        super().update_replicas(replicas)
        policy = self._policy()
        with policy.lock:
            policy.set_replicas([r.replica_id for r in replicas])

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        policy = self._policy()
        with policy.lock:
            policy.remove_replica(replica_id)
