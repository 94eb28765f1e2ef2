"""A replica's adapter registries, one per run, and its fleet's attached runs (docs/FLEET.md).

The run "" is the standalone service: its registry is the replica's constructor's. A fleet run's is
`REGISTRY_NAME` in `run_namespace(RUN)`, looked up when first needed and looked up again after a failed
call (a run that ended takes its registry with it). Live versions are cached for LIVE_CACHE_S, for REST
name resolution; every adapter change on the replica drops its run's entry.

Named actors are found through an injected `actors(name, namespace)` that returns an object whose methods
are awaited directly (`await registry.get(v)`); the default wraps Ray's named actors, a unit test passes
in-process fakes. It raises ValueError when no such actor exists, as `ray.get_actor` does.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from common.names import NAMESPACE, REGISTRY_NAME, fleet_app, run_namespace
from serve_deployments.engine_weights import ReplicaError

log = logging.getLogger("ray.serve")

LIVE_CACHE_S = 1.0  # REST resolves names against the registry's live versions as of at most this long ago


class RegistryGone(ReplicaError):
    """A run's registry cannot be found or called (the run ended, or never attached)."""


def root_message(e: Exception) -> str:
    """The last line of an error (a Ray task error's cause), for one-line messages."""
    cause = getattr(e, "cause", None) or e
    return str(cause).strip().splitlines()[-1] if str(cause).strip() else type(cause).__name__


class _ActorCalls:
    """`await calls.method(*args)` for `await handle.method.remote(*args)`."""

    def __init__(self, handle):
        self._handle = handle

    def __getattr__(self, method: str):
        remote = getattr(self._handle, method).remote

        async def call(*args):
            return await remote(*args)

        return call


def ray_actor(name: str, namespace: str) -> _ActorCalls:
    import ray

    return _ActorCalls(ray.get_actor(name, namespace=namespace))


class RunRegistries:
    def __init__(self, base: tuple[str, str] | None, fleet: str | None = None,
                 actors: Callable[[str, str], object] | None = None):
        self._base = base  # (name, namespace) of the run ""'s registry; None on a fleet replica without one
        self.fleet = fleet
        self._actors = actors or ray_actor
        self._handles: dict[str, object] = {}
        self._live: dict[str, tuple[float, list[int]]] = {}  # run -> (valid until, live versions)

    def handle(self, run: str):
        """Run `run`'s registry (cached); RegistryGone when it cannot be found."""
        handle = self._handles.get(run)
        if handle is not None:
            return handle
        if run:
            name, namespace = REGISTRY_NAME, run_namespace(run)
        elif self._base is not None:
            name, namespace = self._base
        else:
            raise RegistryGone("this fleet replica serves no standalone versions (no registry for them)", 404)
        try:
            handle = self._actors(name, namespace)
        except ValueError as e:
            who = f"run {run}" if run else "this replica"
            raise RegistryGone(f"{who} has no adapter registry ({name} in namespace {namespace}): "
                               f"{'the run ended or never attached' if run else root_message(e)}", 404) from e
        self._handles[run] = handle
        return handle

    async def call(self, run: str, method: str, *args):
        """`registry.method(*args)` of run `run`'s registry; a failed call drops the cached handle (the
        registry may be a new one, or gone with its run) and raises."""
        handle = self.handle(run)
        try:
            return await getattr(handle, method)(*args)
        except Exception:
            if self._handles.get(run) is handle:
                del self._handles[run]
            raise

    async def live(self, run: str, cached: bool = False) -> list[int]:
        """Run `run`'s live versions, oldest first. RegistryGone when its registry is gone; none for the run ""
        of a fleet replica without a registry of its own. `cached`: as of at most LIVE_CACHE_S ago."""
        hit = self._live.get(run) if cached else None
        if hit is not None and hit[0] > time.monotonic():
            return hit[1]
        try:
            live = sorted(await self.call(run, "live_versions"))
            self._live[run] = (time.monotonic() + LIVE_CACHE_S, live)
            return live
        except RegistryGone:
            if run or not self.fleet:
                raise
            return []
        except Exception as e:
            raise RegistryGone(f"the adapter registry of {f'run {run}' if run else 'this replica'} failed: "
                               f"{root_message(e)}", 404 if run else 503) from e

    def changed(self, run: str | None = None) -> None:
        """Run `run`'s versions changed (every run's: None): REST asks its registry again."""
        if run is None:
            self._live.clear()
        else:
            self._live.pop(run, None)

    def forget(self, run: str) -> None:
        self._handles.pop(run, None)
        self._live.pop(run, None)

    async def fleet_runs(self) -> dict:
        """The fleet's attached runs, `{run: {"slots", ...}}`, from its FleetState (raises when unreachable)."""
        return await self._actors(fleet_app(self.fleet), NAMESPACE).runs()
