"""A replica's adapters by run: loading from the runs' registries, quotas, unloading, forgetting a run,
expiring versions, and admitting requests onto a version (`hold`).

The policy of which slot to take is adapter_slots.py's and getting weights into the engine is
engine_weights.py's; this object keeps what is about requests and runs: the load lock (one slot change at
a time), versions being unloaded, runs leaving, expired versions and the rollout requests to abort when
their version expires. What the replica guarantees is in replica.py's docstring.
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager

from common.adapter_io import AdapterError, unpack_tensors
from common.types import adapter_name, check_run_name, policy_name
from serve_deployments.adapter_slots import AdapterKey, AdapterSlots
from serve_deployments.engine_weights import AdapterTransport, MergedTransport, ReplicaError, payload_kind
from serve_deployments.partial_rollouts import PartialTable
from serve_deployments.replica_registries import RunRegistries, root_message

log = logging.getLogger("ray.serve")


class VersionExpiredError(ReplicaError):
    """A rollout request's version expired (the registry trimmed it: older than every live version, so
    older than max_staleness allows): its samples could only be dropped, so it is not generated."""

    def __init__(self, version: int | str, status_code: int = 410, run: str = ""):
        if isinstance(version, str):  # unpickled: the message itself
            super().__init__(version, status_code)
            return
        super().__init__(f"{adapter_name(version, run)} expired (older than every live version): its rollout "
                         "samples would be dropped as too stale, so the request was not (or no longer) "
                         "generated", status_code)


def check_run(run) -> str:
    """A request's run name ("" or absent: the standalone run); ReplicaError 400 when malformed."""
    try:
        return check_run_name(run or "")
    except ValueError as e:
        raise ReplicaError(str(e), 400) from None


def _vname(version: int, run: str = "") -> str:
    return "the base model (version 0)" if version == 0 else adapter_name(version, run)


class ReplicaAdapters:
    def __init__(self, slots: AdapterSlots, transport: AdapterTransport, merged: MergedTransport,
                 registries: RunRegistries, replica_id: str):
        self.slots, self.transport, self.merged, self.registries = slots, transport, merged, registries
        self.replica_id = replica_id
        self.load_lock = asyncio.Lock()  # one slot change at a time: choose victim, load, register
        self.open = asyncio.Event()  # cleared while merged weights are swapped in
        self.open.set()
        self._draining: set[AdapterKey] = set()  # adapters being unloaded: refuse new requests
        self._leaving: set[str] = set()  # runs being forgotten: refuse new requests and loads
        self.expired: set[AdapterKey] = set()  # versions the registry trimmed: rollout requests refused/aborted
        self._droppable: dict[AdapterKey, set] = {}  # adapter -> running rollout requests (drop_if_expired)
        self.aborted_expired = 0
        self.partial = PartialTable()  # running partial rollout requests (rollout.partial): moved, not aborted
        self.rejected: dict[AdapterKey, str] = {}  # live versions whose payload failed verification at start

    @property
    def base_version(self) -> int:
        """What the engine's base weights are: 0 = the original model, N = merged policy-vN (merge mode)."""
        return self.merged.version

    def served_sha(self, version: int, run: str = "") -> str | None:
        """sha256 of the payload behind run `run`'s `version` here (None for the original base model)."""
        if not run and version == self.base_version:
            return self.merged.sha256
        return self.slots.digest(version, run)  # fixed per adapter: a name never gets other weights

    # ------------------------------------------------------------------ start and runs

    async def join_fleet(self) -> None:
        """Fleet start: the attached runs' quotas and live versions, from the fleet's FleetState. A run whose
        registry is gone is skipped (the fleet forgets it when its lease runs out)."""
        self.slots.set_quota("", 0)  # the attached runs own the slots
        fleet = self.registries.fleet
        try:
            runs = await self.registries.fleet_runs()
        except Exception as e:
            log.warning("replica %s: fleet %s has no state to read the runs from (%s); starting with none",
                        self.replica_id, fleet, root_message(e))
            return
        for run, info in sorted(runs.items()):
            try:
                self.slots.set_quota(check_run(run), int(info["slots"]))
                await self.load_live(run)
            except Exception as e:  # its registry is gone, or its name or slots are bad: not this replica's to fix
                log.warning("replica %s: fleet %s run %s skipped at start: %s", self.replica_id, fleet, run,
                            root_message(e))

    async def _refresh_quota(self, run: str) -> None:
        """A run with no quota here yet (it attached while this replica started, so the quota broadcast
        missed it): read its slots from the FleetState."""
        if not run or not self.registries.fleet or run in self.slots.quotas():
            return
        try:
            info = (await self.registries.fleet_runs()).get(run)
        except Exception as e:
            log.warning("replica %s: quota of run %s: fleet state unreachable (%s)", self.replica_id, run,
                        root_message(e))
            return
        if info is not None:
            self.slots.set_quota(run, int(info["slots"]))

    async def load_live(self, run: str, update_weights=None) -> None:
        """Start/restart: serve run `run`'s live versions before taking traffic (the newest its slots hold
        if they outnumber them; merged payloads set the base weights through `update_weights`, the run ""
        only)."""
        live = await self.registries.live(run)
        metas = {v: (await self.registries.call(run, "get", v))["meta"] for v in live}
        merged = [v for v in live if payload_kind(metas[v]) == "merged"]
        if merged and not run and update_weights is not None:
            await update_weights(max(merged))
        adapters = [v for v in live if payload_kind(metas[v]) == "adapter" and (run or v > self.base_version)]
        room = self.slots.quota(run)
        for v in adapters[-room:] if room else []:
            try:
                await self.load(v, run)
            except ReplicaError as e:
                if e.status_code != 422:
                    raise
                # A payload no replica can serve must not keep this one from starting; requests
                # for it fail with the same clear error.
                self.rejected[AdapterKey(run, v)] = str(e)
                log.error("replica %s: live %s", self.replica_id, e)

    def set_quota(self, run: str, slots: int) -> dict:
        run = check_run(run)
        try:
            self.slots.set_quota(run, int(slots))
        except ValueError as e:
            raise ReplicaError(str(e), 400) from None
        return {"run": run, "slots": int(slots), "versions": self.slots.versions(run), "replica_id": self.replica_id}

    async def forget_run(self, run: str, timeout_s: float = 30.0) -> dict:
        """replica.py's `forget_run`."""
        run = check_run(run)
        self.registries.changed(run)
        if not run:
            raise ReplicaError("the standalone run cannot be forgotten; unload its versions instead", 400)
        self._leaving.add(run)
        try:
            aborted = self.expire(sorted({k.version for k in self._droppable if k.run == run}), run)
            aborted += self.partial.cancel_run(run)
            deadline = time.monotonic() + timeout_s
            unloaded = None
            while unloaded is None:
                while self.slots.ongoing(run):
                    if time.monotonic() > deadline:
                        busy = {k.name: n for k, n in self.slots.inflight.items() if k.run == run}
                        raise ReplicaError(f"forget run {run}: requests still in flight after {timeout_s:.0f}s "
                                           f"{busy}; nothing unloaded", 409)
                    await asyncio.sleep(0.01)
                async with self.load_lock:
                    # A request whose on-demand load this lock waited for may have taken its slot meanwhile.
                    if not self.slots.ongoing(run):
                        unloaded = await self.transport.forget(run)
            self.registries.forget(run)
            self.expired = {k for k in self.expired if k.run != run}
            self.rejected = {k: m for k, m in self.rejected.items() if k.run != run}
            return {"run": run, "unloaded": unloaded, "aborted": aborted, "replica_id": self.replica_id}
        finally:
            self._leaving.discard(run)

    # ------------------------------------------------------------------ loading and unloading

    async def load(self, version: int, run: str = "") -> dict:
        """replica.py's `load_adapter`."""
        version, run = int(version), check_run(run)
        self.registries.changed(run)
        if version < 1:
            raise ReplicaError(f"policy versions start at 1, got {version}")
        if run in self._leaving:
            raise ReplicaError(f"run {run} is leaving this fleet: {adapter_name(version, run)} is not loaded", 410)
        already = {"version": version, "run": run, "name": adapter_name(version, run), "loaded": True,
                   "already": True, "replica_id": self.replica_id}
        if self.slots.is_loaded(version, run):
            return already
        async with self.load_lock:
            if self.slots.is_loaded(version, run):
                return already
            return await self._load_locked(version, run)

    async def _load_locked(self, version: int, run: str) -> dict:
        name = adapter_name(version, run)
        if not run and self.base_version and version <= self.base_version:
            raise ReplicaError(f"{name} predates the merged weights of "
                               f"{policy_name(self.base_version)} this replica serves as its base model", 410)
        t0 = time.perf_counter()
        await self._refresh_quota(run)
        tensors, meta, packed = await self.fetch(version, run)
        fetched = time.perf_counter() - t0
        if run and payload_kind(meta) == "merged":
            raise ReplicaError(f"{name} rejected: merged weights cannot be served on a fleet (they would replace "
                               "the base model every run shares)", 422)
        out = await self.transport.load(version, tensors, meta, run, packed)
        # The one place a version of a run goes live here: partial rollouts (policy `all`) move to it.
        self.partial.newer_loaded(version, run)
        return {"version": version, "run": run, "name": name, "loaded": True, "already": False,
                "replica_id": self.replica_id, "evicted": out["evicted"], "seconds": time.perf_counter() - t0,
                "fetch_seconds": fetched, **{k: out[k] for k in ("add_lora_ms", "verify_ms", "evict_ms", "write_ms")}}

    async def fetch(self, version: int, run: str = "") -> tuple[dict, dict, bytes | None]:
        """Run `run`'s version from its registry: (tensors, meta, the packed buffer they came from, if packed)."""
        try:
            entry = await self.registries.call(run, "get", version)
        except Exception as e:
            if await self.trimmed(version, run):  # gone, not missing: the rollout starts over under the newest
                raise VersionExpiredError(version, run=run) from e
            raise ReplicaError(f"{adapter_name(version, run)} is not loaded here and the registry does not hold "
                               f"it ({root_message(e)})", 404) from e
        try:
            payload = await entry["ref"][0]
            tensors = unpack_tensors(payload)
        except AdapterError as e:
            raise ReplicaError(f"{adapter_name(version, run)} rejected: {e}", 422) from e
        return tensors, entry["meta"], bytes(payload) if isinstance(payload, (bytes, bytearray, memoryview)) else None

    async def unload(self, version: int, run: str = "", timeout_s: float = 600.0) -> bool:
        """replica.py's `unload_adapter`."""
        version, run = int(version), check_run(run)
        self.registries.changed(run)
        if not self.slots.is_loaded(version, run):
            return False
        key = AdapterKey(run, version)
        self._draining.add(key)
        # Partial rollouts under it move on (to the run's newest version left) instead of holding the unload for
        # the rest of their completions: the rollback of a load that a lost replica failed unloads the version
        # the survivors' partial samples (policy all) had just moved to.
        self.partial.leaving(version, run)
        try:
            deadline = time.monotonic() + timeout_s
            while self.slots.inflight_of(version, run):
                if time.monotonic() > deadline:
                    raise ReplicaError(f"unload {key.name}: {self.slots.inflight_of(version, run)} requests "
                                       f"still in flight after {timeout_s:.0f}s", 409)
                await asyncio.sleep(0.01)
            async with self.load_lock:
                if not self.slots.is_loaded(version, run):
                    return False
                await self.transport.evict(version, run)
                return True
        finally:
            self._draining.discard(key)

    # ------------------------------------------------------------------ requests

    @asynccontextmanager
    async def hold(self, version: int, run: str = ""):
        """Admit one request on run `run`'s `version`: wait out a weight swap, load on demand, hold the slot;
        yields its LoRA request (None: the base weights). Version 0 is the base model; a fleet run's too
        while the base weights are the original ones."""
        await self.open.wait()
        if run in self._leaving:
            raise ReplicaError(f"run {run} is leaving this fleet: {_vname(version, run)} is no longer served", 410)
        base = self.base_version
        if version == base and (not run or version == 0):  # a fleet run's version is never merged
            lora = None
        elif version == 0 or (not run and version < base):
            raise ReplicaError(f"{_vname(version, run)} is no longer served: this replica's base weights are "
                               f"merged {policy_name(base)}", 410)
        else:
            key = AdapterKey(run, version)
            if key in self._draining:
                raise ReplicaError(f"{key.name} is being unloaded from this replica", 410)
            if not self.slots.is_loaded(version, run):
                await self.load(version, run)
            # No await between the check above and acquire: eviction cannot slip in.
            if not self.slots.is_loaded(version, run):
                raise ReplicaError(f"{key.name} was evicted while loading; retry", 503)
            lora = self.transport.request(version, run)
        self.slots.acquire(version, run)
        try:
            yield lora
        finally:
            self.slots.release(version, run)

    def newest(self, run: str = "") -> int | None:
        """The newest version of run `run` this replica serves to rollouts now (loaded, neither expired nor
        being unloaded nor rejected); None when it has none. Where a partial rollout continues."""
        bad = self.expired | self._draining | set(self.rejected)
        ok = [v for v in self.slots.versions(run) if AdapterKey(run, v) not in bad]
        return max(ok) if ok else None

    def is_expired(self, version: int, run: str = "") -> bool:
        return AdapterKey(run, version) in self.expired

    async def trimmed(self, version: int, run: str = "") -> bool:
        """Whether run `run`'s `version` is expired here, or not loaded here and trimmed by its registry (older
        than every live version; then recorded as expired): a replica that Serve started after the trim (one
        replacing a lost replica) never got the `expire` call, and a request retried onto it still names it."""
        key = AdapterKey(run, version)
        if key in self.expired:
            return True
        if version < 1 or self.slots.is_loaded(version, run):
            return False
        try:
            live = await self.registries.live(run)
        except Exception:  # no registry to ask: the load path reports that clearly
            return False
        if live and version < live[0]:
            self.expired.add(key)
            return True
        return False

    def is_draining(self, version: int, run: str = "") -> bool:
        return AdapterKey(run, version) in self._draining

    def check_expired(self, version: int, run: str = "") -> None:
        """VersionExpiredError when a rollout request (`drop_if_expired`) names an expired version."""
        if AdapterKey(run, version) in self.expired:
            raise VersionExpiredError(version, run=run)

    def track(self, version: int, run: str, task: asyncio.Future) -> None:
        """A running rollout request that `expire` cancels (`drop_if_expired`)."""
        self._droppable.setdefault(AdapterKey(run, version), set()).add(task)

    def untrack(self, version: int, run: str, task: asyncio.Future) -> None:
        key = AdapterKey(run, version)
        tasks = self._droppable.get(key, set())
        tasks.discard(task)
        if not tasks:
            self._droppable.pop(key, None)

    def expire(self, versions: list[int], run: str = "") -> int:
        """replica.py's `expire`: returns the number of rollout requests cancelled (partial ones move to the
        run's newest version instead, and are not counted)."""
        run = check_run(run)
        self.registries.changed(run)
        self.partial.expired(versions, run)
        n = 0
        for v in map(int, versions):
            key = AdapterKey(run, v)
            self.expired.add(key)
            for task in list(self._droppable.pop(key, ())):
                n += int(task.cancel())
        self.aborted_expired += n
        return n
