"""The replica deployment as the ingress calls it: its engine's facts, the route of each call, and calls
to one replica or to all.

Routing: the ingress owns the RoutingPolicy (router.policy prefix or round_robin; None = Serve's own
request router, router.policy serve_default). A call that carries a prompt brings a RouteTicket (the
policy and the prompt's route key) to `choose_replica`, where the replica deployment's PolicyRouter asks
it (request_router.py, replica_calls.py). State changes go to every replica with
`DeploymentHandle.broadcast`. See docs/ARCHITECTURE.md, "Serving".
"""
from __future__ import annotations

from ray.serve.handle import DeploymentHandle

from common.types import adapter_name
from serve_deployments import prefix_hash
from serve_deployments.replica_calls import ReplicaCall, call_replica
from serve_deployments.request_router import RouteTicket, RoutingPolicy

BROADCAST_TIMEOUT_S = 120.0  # adapter loads: fetch + verify + add_lora on every replica


class ReplicaPool:
    def __init__(self, handle: DeploymentHandle, policy: RoutingPolicy | None):
        self._handle = handle
        self._policy = policy
        self._engine: dict | None = None

    async def engine_info(self) -> dict:
        """The replicas' engine facts (model, max_model_len, block_size, max_loras), asked once."""
        if self._engine is None:
            self._engine = await call_replica(self._handle, "engine_info")
        return self._engine

    async def route_key(self, token_ids: list[int], version: int, merged_version: int, run: str = "") -> dict | None:
        """The prompt's route key under run `run`'s `version` (the base weights being `merged_version`'s), or
        None under Serve's own request router. The adapter's name seeds the hashes: two runs' versions never
        share a prefix entry."""
        if self._policy is None:
            return None
        block_size = (await self.engine_info())["block_size"]
        if version > 0 and version != merged_version:
            return prefix_hash.route_key(token_ids, block_size, adapter_name(version, run))
        # Merged weights are new base weights: their blocks must not match the original base model's.
        return prefix_hash.route_key(token_ids, block_size, None, salt=f"merged-v{version}" if version else "")

    def ticket(self, key: dict | None, weight: int = 1) -> RouteTicket | None:
        """One call's routing request (each call its own: the policy tracks calls one by one), `weight` the
        sequences it runs."""
        return RouteTicket(self._policy, key, weight) if self._policy is not None else None

    async def call(self, method: str, *args, key: dict | None = None, weight: int = 1):
        """`method(*args)` on one replica, routed by `key` (None: the least loaded), counted as `weight`
        sequences of the replica's load; its result."""
        return await call_replica(self._handle, method, *args, ticket=self.ticket(key, weight))

    def stream(self, method: str, key: dict | None) -> ReplicaCall:
        """An unopened streaming call of `method`, routed by `key` (the caller opens, sends and closes it)."""
        return ReplicaCall(self._handle, method, self.ticket(key), stream=True)

    async def broadcast(self, method: str, *args, timeout_s: float = BROADCAST_TIMEOUT_S
                        ) -> tuple[list, list[BaseException]]:
        """`method(*args)` on every replica: (the results, the errors); a timeout is one error, and so is a
        handle that knows no replica yet (Serve's DeploymentUnavailableError while a restarted controller
        repopulates it): callers count errors, /health and stats report them instead of failing."""
        try:
            results = await self._handle.broadcast(method, *args).results_async(
                timeout_s=timeout_s, return_exceptions=True)
        except Exception as e:  # incl. TimeoutError; cancellation (a BaseException) still propagates
            return [], [e]
        return ([r for r in results if not isinstance(r, BaseException)],
                [r for r in results if isinstance(r, BaseException)])

    def router_stats(self) -> dict:
        """The request router's counters (affinity / spill / unmatched, predicted hit blocks)."""
        if self._policy is None:
            return {"policy": "serve_default"}
        with self._policy.lock:
            return self._policy.snapshot()
