"""How a published version's weights get into a running engine: one object per transport (sync.mode).

- `AdapterTransport` (adapter mode): a run's version's LoRA tensors are verified against the base model,
  written as a PEFT dir on tmpfs and registered with the engine (`add_lora`) in one of the replica's
  `AdapterSlots`, evicting that run's oldest idle version to make room (`remove_lora`). The run "" is a
  standalone service; other runs share a fleet's replicas (docs/FLEET.md).
- `MergedTransport` (merge mode): the version's merged full weights are verified, staged as one
  safetensors file, and swapped in as the engine's base weights (`collective_rpc("load_merged_weights")`,
  then the prefix cache is reset): the base model then IS that version.

The engine is injected (anything with async `add_lora`, `remove_lora`, `collective_rpc`,
`reset_prefix_cache`), and so is the LoRA request type: tests/test_weight_transport.py runs both
transports against a fake engine, without vLLM. `payload_kind(meta)` is the one reader of a payload's kind.
The replica keeps what is about requests: fetching from the registry, the load lock, and closing
admission while merged weights are swapped.
"""
from __future__ import annotations

import time
from pathlib import Path

from common.adapter_io import AdapterError
from common.types import adapter_name, lora_int_id, policy_name
from serve_deployments.adapter_files import (
    BaseModelShapes,
    remove_dir,
    verify_adapter,
    verify_merged,
    write_adapter_dir,
)
from serve_deployments.adapter_slots import AdapterKey, AdapterSlots, SlotsFullError


class ReplicaError(ValueError):
    """A request or load a replica refuses, with the HTTP status the ingress should answer."""

    def __init__(self, message: str, status_code: int = 400):
        super().__init__(message)
        self.status_code = status_code

    def __reduce__(self):  # keep status_code when Ray pickles it to the caller
        return (type(self), (str(self), self.status_code))


FLEET_LORA_ID_START = 1_000_000  # first LoRA int id of a fleet run's adapter (run "" uses id = version)


def payload_kind(meta: dict) -> str:
    """`adapter` (LoRA tensors) or `merged` (full weights): which transport serves a payload."""
    return meta.get("kind", "adapter")


def _vllm_lora_request(name: str, int_id: int, path: str):
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, int_id, path)


class AdapterTransport:
    """LoRA adapters in the engine, one per slot, keyed by (run, version). `requests` maps a served name
    (`adapter_name`) to its LoRA request (the replica passes vLLM's OpenAI model registry, so its serving
    classes see every loaded adapter).

    vLLM keys adapters (and their prefix-cache blocks) by the LoRA int id, so an id must never name two
    different weights: the run "" keeps id = version; a fleet run's adapter gets an id from a replica-local
    counter starting at FLEET_LORA_ID_START, the same one while the run stays attached (its weights are
    fixed by the digest) and never handed out again, also not to a later run of the same name."""

    def __init__(self, engine, slots: AdapterSlots, shapes: BaseModelShapes, scratch: Path, max_rank: int,
                 requests: dict | None = None, lora_request=_vllm_lora_request):
        self.engine, self.slots, self.shapes, self.scratch, self.max_rank = engine, slots, shapes, scratch, max_rank
        self.requests = requests if requests is not None else {}
        self._lora_request = lora_request
        self.add_lora_ms: list[float] = []
        self._ids: dict[AdapterKey, int] = {}  # fleet runs' adapters -> their LoRA int id
        self._next_id = FLEET_LORA_ID_START

    def lora_id(self, version: int, run: str = "") -> int:
        """The LoRA int id of (run, version) on this replica (class docstring)."""
        if not run:
            return lora_int_id(version)
        key = AdapterKey(run, version)
        if key not in self._ids:
            self._ids[key] = self._next_id
            self._next_id += 1
        return self._ids[key]

    async def load(self, version: int, tensors: dict, meta: dict, run: str = "", packed: bytes | None = None) -> dict:
        """Verify and register run `run`'s `version`; on a bad payload raise ReplicaError (422) and leave every
        loaded adapter serving; with every slot the run may take busy raise ReplicaError (503). Returns
        {"evicted": name of the adapter evicted to make room, or None, "add_lora_ms"}."""
        name = adapter_name(version, run)
        t0 = time.perf_counter()
        try:
            verify_adapter(tensors, meta, self.shapes, self.max_rank)
            self.slots.check_digest(version, meta["sha256"], run)
        except (AdapterError, ValueError) as e:
            raise ReplicaError(f"{name} rejected: {e}", 422) from e
        try:
            victim = self.slots.victim(run)
        except SlotsFullError as e:
            raise ReplicaError(str(e), 503) from e
        t1 = time.perf_counter()
        if victim is not None:
            await self.evict(victim.version, victim.run)
        t2 = time.perf_counter()
        # `/` would make a subdirectory; `@` is in no run name, so the dir names stay distinct.
        path = write_adapter_dir(tensors, meta, self.scratch, f"{name.replace('/', '@')}-{meta['sha256'][:12]}",
                                 packed)
        req = self._lora_request(name, self.lora_id(version, run), str(path))
        t3 = time.perf_counter()
        try:
            await self.engine.add_lora(req)
        except Exception as e:
            remove_dir(path)
            raise ReplicaError(f"{name} rejected by the engine: {e}", 422) from e
        self.add_lora_ms.append((time.perf_counter() - t3) * 1e3)
        self.slots.add(version, str(path), meta["sha256"], run)
        self.requests[name] = req
        return {"evicted": victim.name if victim is not None else None, "add_lora_ms": self.add_lora_ms[-1],
                "verify_ms": (t1 - t0) * 1e3, "evict_ms": (t2 - t1) * 1e3, "write_ms": (t3 - t2) * 1e3}

    def request(self, version: int, run: str = ""):
        return self.requests[adapter_name(version, run)]

    async def evict(self, version: int, run: str = "") -> None:
        """Only for an adapter with nothing in flight (the caller holds its load lock)."""
        path = self.slots.remove(version, run)  # before any await: no request can take it meanwhile
        self.requests.pop(adapter_name(version, run), None)
        await self.engine.remove_lora(self.lora_id(version, run))
        if path:
            remove_dir(path)

    async def evict_all(self, run: str | None = None) -> None:
        """Evict every adapter (merged weights replaced the base they were deltas on), or run `run`'s."""
        for key in self.slots.keys():
            if run is None or key.run == run:
                await self.evict(key.version, key.run)

    async def forget(self, run: str) -> list[int]:
        """Run `run` left: evict its adapters (idle: the caller drained them), drop its quota, digests and
        LoRA ids (the ids are never handed out again). Returns the versions evicted."""
        versions = self.slots.versions(run)
        await self.evict_all(run)
        self.slots.forget(run)
        self._ids = {k: i for k, i in self._ids.items() if k.run != run}
        return versions


class MergedTransport:
    """Merged full weights as the engine's base weights. `version` / `sha256`: what the base weights are
    now (0 / None: the original model)."""

    def __init__(self, engine, shapes: BaseModelShapes, scratch: Path):
        self.engine, self.shapes, self.scratch = engine, shapes, scratch
        self.version = 0
        self.sha256: str | None = None
        self.lora_wrappers = 0  # LoRA-wrapped layers the last swap loaded around (merged_weights_extension.py)
        # The update in progress and its step ("policy-v18: fetch"), None between updates: in the replica's stats,
        # so an update that never ends says where it stopped.
        self.pending: str | None = None

    def holds(self, version: int, meta: dict) -> bool:
        """True when the engine already runs these weights (a tagged version carries the same digest)."""
        return version == self.version or bool(meta.get("sha256") and meta["sha256"] == self.sha256)

    def stage(self, version: int, tensors: dict, meta: dict) -> Path:
        """Verify and write the weights for `swap` (ReplicaError 422 on a bad payload)."""
        from safetensors.torch import save_file

        try:
            verify_merged(tensors, meta, self.shapes)
        except AdapterError as e:
            raise ReplicaError(f"{policy_name(version)} merged weights rejected: {e}", 422) from e
        path = self.scratch / f"merged-{policy_name(version)}.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
        return path

    async def swap(self, version: int, path: Path, sha256: str | None) -> None:
        """Load staged weights in place; no request may run meanwhile (the caller closed admission).
        Adapters were deltas on the old base: the caller drops them."""
        try:
            results = await self.engine.collective_rpc("load_merged_weights", args=(str(path),))
            self.lora_wrappers = max((r.get("lora_wrappers", 0) for r in results or [] if isinstance(r, dict)),
                                     default=0)
            await self.engine.reset_prefix_cache()  # old base-model blocks are stale
            self.version, self.sha256 = version, sha256
        finally:
            path.unlink(missing_ok=True)

    def tag(self, version: int) -> None:
        """A tagged version (same digest as the weights served): the base weights are now its."""
        self.version = version
