"""State changes sent to every replica: adapter loads and unloads, merged weights, expiry, pause, resume.

Each goes to all replicas with `DeploymentHandle.broadcast` (replica_pool.py), one at a time (loads,
unloads and weight updates hold one lock). An adapter load is all or nothing: if any replica fails it,
the version is unloaded from the replicas that took it and the error raised, and what was live stays
live; the registry marks a version live only after `load_adapter` returned.

A failure caused by a lost replica (`common.faults.is_lost`: it died or Serve had none to offer) raises a
`BroadcastLost`, a `LostError`, so the registry retries the load through a fresh handle; a replica that
refused (a bad payload) raises the plain error, which is final. See docs/ARCHITECTURE.md, "Faults".
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import NoReturn

from common.faults import LostError, is_lost, short_error
from common.types import adapter_name
from serve_deployments.engine_weights import payload_kind
from serve_deployments.replica_pool import ReplicaPool
from serve_deployments.served_versions import RunVersions

logger = logging.getLogger("ray.serve")


class BroadcastError(RuntimeError):
    """A state change some replica did not take."""


class BroadcastLost(BroadcastError, LostError):
    """A state change that failed because a replica was lost: worth retrying once Serve replaced it."""


class AdapterLoadError(BroadcastError):
    """A version some replica failed to load; it was rolled back everywhere and is not live."""


class AdapterLoadLost(AdapterLoadError, BroadcastLost):
    """An adapter load that failed because a replica was lost (rolled back everywhere, not live)."""


def _raise_for(errors: list[BaseException], message: str, error: type[BroadcastError] = BroadcastError,
               lost: type[BroadcastLost] = BroadcastLost) -> NoReturn:
    """Raise `lost(message)` if any of the replicas' errors says a replica was lost, else `error(message)`."""
    raise (lost if any(is_lost(e) for e in errors) else error)(message)


class WeightsBroadcaster:
    def __init__(self, pool: ReplicaPool, runs: RunVersions):
        self._pool = pool
        self._runs = RunVersions.of(runs)
        self._lock = asyncio.Lock()  # one state change at a time: loads, unloads, weight updates

    @property
    def _versions(self):
        return self._runs.base

    @staticmethod
    def _run_args(run: str) -> tuple:
        return (run,) if run else ()  # a standalone call stays the call it always was

    async def load_adapter(self, version: int, run: str = "") -> dict:
        """Load run `run`'s version (from its registry) on every replica, all or nothing (module
        docstring). A merged payload (merge mode, standalone only) goes to `update_weights`: same protocol."""
        versions = self._runs.get(run)
        try:
            kind = payload_kind((await versions.entry(version))["meta"])
        except Exception:
            kind = "adapter"  # the replicas answer the clear "registry does not hold it" error
        if kind == "merged":
            if run:
                raise AdapterLoadError(f"{adapter_name(version, run)}: merged weights cannot be served on a "
                                       "fleet (sync.mode merge replaces the base model every run shares)")
            return await self.update_weights(version)
        name = adapter_name(version, run)
        async with self._lock:
            t0 = time.perf_counter()
            ok, errors = await self._pool.broadcast("load_adapter", version, *self._run_args(run))
            if errors or not ok:
                _, undo_errors = await self._pool.broadcast("unload_adapter", version, *self._run_args(run))
                why = "; ".join(sorted({short_error(e) for e in errors})) or "no replica answered"
                if undo_errors:
                    why += f" (rollback failed on {len(undo_errors)}: {short_error(undo_errors[0])})"
                _raise_for(errors, f"{name} rejected by {len(errors)} of {len(ok) + len(errors)} "
                                   f"replicas, rolled back: {why}", AdapterLoadError, AdapterLoadLost)
            versions.unloaded.discard(version)
            return {"version": version, "name": name, "replicas": len(ok),
                    "seconds": time.perf_counter() - t0, "results": ok}

    async def unload_adapter(self, version: int, run: str = "") -> dict:
        """Stop offering a version and drop it from every replica (in-flight requests finish first:
        the replicas' slot managers never evict an adapter in use)."""
        versions = self._runs.get(run)
        async with self._lock:
            versions.unloaded.add(version)
            ok, errors = await self._pool.broadcast("unload_adapter", version, *self._run_args(run))
            if errors:
                _raise_for(errors, f"unload {adapter_name(version, run)}: {len(errors)} replicas failed: "
                                   f"{short_error(errors[0])}")
            return {"version": version, "name": adapter_name(version, run), "replicas": len(ok)}

    async def set_quota(self, run: str, slots: int) -> dict:
        """A fleet run's adapter slots on every replica (it evicts only its own versions, within them)."""
        async with self._lock:
            ok, errors = await self._pool.broadcast("set_quota", run, int(slots))
            if errors:
                _raise_for(errors, f"run {run}: setting {slots} slots failed on {len(errors)} replicas: "
                                   f"{short_error(errors[0])}")
            return {"run": run, "slots": slots, "replicas": len(ok)}

    async def forget_run(self, run: str) -> dict:
        """A fleet run left (detached, or its lease ran out): every replica aborts its rollouts and unloads
        its adapters; no other run's slot is touched."""
        async with self._lock:
            ok, errors = await self._pool.broadcast("forget_run", run)
            if errors:
                _raise_for(errors, f"run {run}: unloading its adapters failed on {len(errors)} replicas: "
                                   f"{short_error(errors[0])}")
            return {"run": run, "replicas": len(ok), "unloaded": sorted({v for r in ok for v in r.get("unloaded", [])}),
                    "aborted": sum(int(r.get("aborted", 0)) for r in ok)}

    async def update_weights(self, version: int) -> dict:
        """Merge mode: every replica swaps in the merged weights of `version`."""
        async with self._lock:
            ok, errors = await self._pool.broadcast("update_weights", version)
            if errors or not ok:
                _raise_for(errors, f"update_weights v{version} failed on {len(errors)} of {len(ok) + len(errors)} "
                                   f"replicas: {short_error(errors[0]) if errors else 'none answered'}")
            # New base weights: old base-model blocks are stale on every replica, so new route keys.
            self._versions.merged_version = version
            return {"version": version, "replicas": len(ok), "results": ok}

    async def expire(self, versions: list[int], run: str = "") -> dict:
        """The registry trimmed these versions: every replica aborts their in-flight rollout requests
        (their samples could only be dropped as stale) so the adapter slots they hold free up at once.
        Best effort: a replica that misses it just lets them finish."""
        ok, errors = await self._pool.broadcast("expire", list(versions), *self._run_args(run))
        if errors:
            logger.warning("expire %s: %d replicas failed: %s", versions, len(errors), short_error(errors[0]))
        return {"versions": list(versions), "aborted": sum(ok), "replicas": len(ok)}

    async def pause(self) -> dict:
        """Every replica holds generation: running requests freeze, new ones queue, until `resume`."""
        ok, errors = await self._pool.broadcast("pause")
        if errors:
            _raise_for(errors, f"pause failed on {len(errors)} replicas: {short_error(errors[0])}")
        return {"paused": len(ok)}

    async def resume(self) -> dict:
        ok, errors = await self._pool.broadcast("resume")
        if errors:
            _raise_for(errors, f"resume failed on {len(errors)} replicas: {short_error(errors[0])}")
        return {"resumed": len(ok)}
