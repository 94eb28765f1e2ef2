"""How the ingress calls one replica: public Serve APIs only, one place for the one non-obvious rule.

A call picks its replica with `DeploymentHandle.choose_replica(route=ticket)` (the deployment's
PolicyRouter asks the ticket: request_router.py) and sends its own arguments with `dispatch(selection, ...)`,
so routing data never reaches the replica. Without a ticket (router.policy serve_default, or a call
with no prompt) the same two calls let the deployment's router pick by load.

Why every call starts in a fresh `contextvars.Context` (checked against Ray 2.60's source, and by
tests/test_serve_contract.py, which fails loudly if a Ray upgrade changes it):
- Serve gives a handle call the internal request id of the request being served (it reads it from a
  context variable), so the n concurrent calls of one `generate_group` share one id;
- its request router hands a chosen replica to the pending request *with that id*, and indexes one
  pending request per id, so with a shared id the 2nd..nth calls are never handed a replica and route
  forever. `choose_replica` does not change this: it goes through the same pending-request queue
  (ray/serve/_private/router.py: choose_replica -> _pick_and_reserve_replica -> _choose_replica_for_request);
- in a fresh context Serve finds no request being served and gives the call an id of its own.
The cost: the replica logs the call under its own request id, not the ingress's; cancelling the
ingress request still cancels the call (it is awaited, and a cancelled await cancels the task).
"""
from __future__ import annotations

import asyncio
import contextvars
from contextlib import AsyncExitStack

from ray.serve.handle import DeploymentHandle

ROUTE_KWARG = "route"  # choose_replica's kwarg that PolicyRouter reads


async def _in_fresh_context(coro):
    return await asyncio.get_running_loop().create_task(coro, context=contextvars.Context())


class ReplicaCall:
    """One call of `method` on one replica: `open()` picks the replica (with `ticket`, the policy's;
    else the least loaded) and reserves a slot on it, `send(*args)` dispatches, `close()` releases the
    reservation and tells the ticket the call ended. A response must be consumed before `close()`
    (Serve's rule for `dispatch`): streams close when their relay ends.

        async with ReplicaCall(handle, "generate", ticket) as call:
            return await call.send(req)
    """

    def __init__(self, handle: DeploymentHandle, method: str, ticket=None, stream: bool = False):
        self._handle = handle.options(method_name=method, stream=stream)
        self._ticket = ticket
        self._stack = AsyncExitStack()
        self.selection = None

    async def open(self):
        cm = self._handle.choose_replica(**{ROUTE_KWARG: self._ticket})
        try:
            self.selection = await _in_fresh_context(self._stack.enter_async_context(cm))
        except BaseException:
            self._done()
            raise
        if self._ticket is not None:
            self._ticket.routed(self.selection.replica_id)
        return self

    def send(self, *args, **kwargs):
        """The DeploymentResponse (or DeploymentResponseGenerator for a stream) of the call."""
        return self._handle.dispatch(self.selection, *args, **kwargs)

    async def close(self) -> None:
        try:
            await self._stack.aclose()
        finally:
            self._done()

    def _done(self) -> None:
        ticket, self._ticket = self._ticket, None
        if ticket is not None:
            ticket.done()

    async def __aenter__(self) -> ReplicaCall:
        return await self.open()

    async def __aexit__(self, *exc) -> None:
        await self.close()


async def call_replica(handle: DeploymentHandle, method: str, *args, ticket=None):
    """`method(*args)` on one replica (the ticket's choice, or the least loaded): its result."""
    async with ReplicaCall(handle, method, ticket) as call:
        return await call.send(*args)
