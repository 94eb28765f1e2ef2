"""Merge mode on a replica: policy-vN's merged full weights become the engine's base weights.

The swap itself is MergedTransport's (engine_weights.py); this is the request side of it: no request runs
across the swap (admission closes, in-flight requests finish first), and the adapters, deltas on the old
base, are dropped afterwards. Merge mode is a standalone service's: its only run is "".
"""
from __future__ import annotations

import asyncio
import time

from common.types import policy_name
from serve_deployments.engine_weights import ReplicaError
from serve_deployments.replica_adapters import ReplicaAdapters


async def update_weights(adapters: ReplicaAdapters, version: int) -> dict:
    """replica.py's `update_weights`."""
    merged, replica_id = adapters.merged, adapters.replica_id
    version = int(version)
    adapters.registries.changed()
    if version == merged.version:
        return {"version": version, "already": True, "replica_id": replica_id}
    if version < merged.version:
        raise ReplicaError(f"{policy_name(version)} is older than the merged {policy_name(merged.version)}", 409)
    t0 = time.perf_counter()

    def step(what: str) -> None:
        merged.pending = f"{policy_name(version)}: {what}"

    try:
        step("registry")
        meta = (await adapters.registries.call("", "get", version))["meta"]
        if merged.holds(version, meta):
            # A tagged version (the trainer's weights did not move): the engine already holds them.
            merged.tag(version)
            return {"version": version, "already": True, "replica_id": replica_id}
        step("fetch")
        tensors, meta, _ = await adapters.fetch(version)
        step("stage")
        path = merged.stage(version, tensors, meta)
        del tensors
        step("load lock")
        async with adapters.load_lock:
            adapters.open.clear()
            try:
                step("drain")
                while adapters.slots.ongoing():
                    await asyncio.sleep(0.01)
                step("swap")
                await merged.swap(version, path, meta.get("sha256"))
                # reload_weights also dropped the runner's LoRA state.
                step("evict adapters")
                await adapters.transport.evict_all()
            finally:
                adapters.open.set()
                path.unlink(missing_ok=True)
    finally:
        merged.pending = None
    return {"version": version, "already": False, "replica_id": replica_id,
            "seconds": time.perf_counter() - t0, "lora_wrappers": merged.lora_wrappers}
