"""AdapterRegistry: the one owner of published adapter payloads (docs/ARCHITECTURE.md, "Versions and
staleness" and "Serving").

Protocol:
- The trainer's rank 0 calls `publish.remote(version, ref, meta)` with the ObjectRef as a top-level
  argument, so this actor receives the *value* and re-puts it: objects a train worker puts die with
  that worker, objects this actor puts live as long as the registry.
- If the ingress (the Serve app's entry deployment) is attached, `publish` asks it to load the version
  on every replica; the version becomes live only when the ingress says every replica acknowledged.
  Otherwise the payload is dropped and the error is raised to the publisher; earlier versions keep
  serving.
- Replicas fetch payloads by version with `get` (also on restart, for every live version).

It is an async actor so `get` calls from replicas are served while `publish` awaits the ingress.

Faults (docs/ARCHITECTURE.md, "Faults"): a replica (or the ingress) lost while a version loads fails
that load on every replica (all or nothing, rolled back); the registry then tries again through a fresh
handle until Serve has replaced or dropped the lost process (`common.faults.ADAPTER_LOAD`, counted in
the record's `load_retries`). A restarted replica loads every live version itself. A replica that
refuses the payload is not retried.
"""
from __future__ import annotations

import asyncio
import time

import ray

from common import faults
from common.names import NAMESPACE, REGISTRY_NAME


@ray.remote(num_cpus=0)
class AdapterRegistry:
    def __init__(self, keep: int = 3):
        self._refs: dict[int, ray.ObjectRef] = {}
        self._meta: dict[int, dict] = {}
        self._live: list[int] = []
        # version -> sha256 of every payload published (or attempted) under it, kept after the payload is trimmed
        # or its publish failed: a rollout's every version stays checkable (a partial sample can hold tokens of a
        # version that a failed publish had loaded on its replica for a moment, or one trimmed since)
        self._digests: dict[int, str | None] = {}
        self._ingress = None  # DeploymentHandle of the Serve app's ingress
        self._ingress_args: tuple | None = None
        self._run_kwargs: dict = {}  # on a fleet: {"run": RUN, "token": its token}, passed with every change
        self._keep = keep  # live versions: max_staleness + 1 (replicas hold one more slot for the swap)
        self._expiring: set[asyncio.Future] = set()  # expire calls in flight (kept from the GC)
        self.expired_aborts = self.expire_errors = 0
        self._last_expire_error: str | None = None
        self.load_retries = 0  # over the registry's life; each publish record has its own count
        # (version, holder) -> time.monotonic() deadline: versions kept past the rollout window for a reader
        # that outlives it (an evaluation scoring one version for a minute while versions turn over every
        # few seconds). A lease, so a reader that dies frees its version by itself.
        self._holds: dict[tuple[int, str], float] = {}

    async def attach_ingress(self, app_name: str | None, deployment_name: str | None = None, run: str = "",
                             token: str | None = None) -> None:
        """Attach the app's ingress (`serve.get_app_handle(app_name)`, or the named deployment of that
        app), or detach with None. On a fleet, `run` and its `token` go with every load and expiry: the
        versions are the run's (`RUN/policy-vN`), and only its token may change them."""
        if app_name is None:
            self._ingress = self._ingress_args = None
            return
        from ray import serve

        self._run_kwargs = {"run": run, "token": token} if run else {}
        self._ingress_args = (app_name, deployment_name, run, token)
        self._ingress = (serve.get_deployment_handle(deployment_name, app_name) if deployment_name
                         else serve.get_app_handle(app_name))

    async def publish(self, version: int, tensors: dict, meta: dict) -> dict:
        """Store a payload (tensors arrive resolved), have every replica load it, mark it live."""
        self._check_new(version)
        return await self._go_live(version, ray.put(tensors), meta)

    async def _go_live(self, version: int, ref: ray.ObjectRef, meta: dict) -> dict:
        t0 = time.perf_counter()
        self._refs[version] = ref
        self._meta[version] = dict(meta, version=version)
        self._digests[version] = meta.get("sha256")
        load_s = 0.0
        retries = 0
        loaded: dict = {}
        if self._ingress is not None:
            t1 = time.perf_counter()

            async def load():
                return await self._ingress.load_adapter.remote(version, **self._run_kwargs)

            async def fresh_handle(retry: int, error: BaseException) -> None:
                nonlocal retries
                retries = retry
                self.load_retries += 1
                await self.attach_ingress(*self._ingress_args)  # the ingress may be a new one

            try:
                loaded = await faults.ADAPTER_LOAD.run(
                    load, on_retry=fresh_handle,
                    retryable=lambda e: faults.is_lost(e) and self._ingress_args is not None)
            except Exception:
                self._forget(version)
                raise
            load_s = time.perf_counter() - t1
        self._live.append(version)
        self._expire_later(self._trim())
        return {"version": version, "nbytes": meta.get("nbytes", 0), "kind": meta.get("kind", "adapter"),
                "load_retries": retries, "seconds": time.perf_counter() - t0, "replica_load_seconds": load_s,
                "time": time.time(), **_slowest_replica(loaded)}

    def _check_new(self, version: int) -> None:
        if version in self._meta:
            raise ValueError(f"policy-v{version} was already published; a version is never reused")
        if self._live and version <= max(self._live):
            raise ValueError(f"policy-v{version} is not newer than live policy-v{max(self._live)}")

    async def tag(self, version: int, of_version: int) -> dict:
        """Publish `version` as the same payload as `of_version` (the trainer's adapter did not move):
        no tensor travels from the trainer, and the replicas load the payload they already fetched once
        under the new name. Same protocol as `publish`: live only when every replica has it."""
        if of_version not in self._refs:
            raise KeyError(f"policy-v{of_version} is not held by the registry (held: {sorted(self._refs)})")
        self._check_new(version)
        meta = {k: v for k, v in self._meta[of_version].items() if k != "version"}
        rec = await self._go_live(version, self._refs[of_version], dict(meta, alias_of=of_version))
        rec["alias_of"] = of_version
        return rec

    async def get(self, version: int) -> dict:
        """`{"ref": [ObjectRef], "meta": dict}`; the ref is inside a list so it is passed, not resolved."""
        if version not in self._refs:
            raise KeyError(f"policy-v{version} is not held by the registry (held: {sorted(self._refs)})")
        return {"ref": [self._refs[version]], "meta": self._meta[version]}

    async def digest(self, version: int) -> str | None:
        """The sha256 of the payload last published (or attempted) under `version`, trimmed or not; KeyError
        for a version never published. A version whose publish failed and was published again names the
        new payload, so tokens of the failed one fail the rollout worker's check instead of passing it."""
        if version not in self._digests:
            raise KeyError(f"policy-v{version} was never published (newest: {max(self._digests, default=None)})")
        return self._digests[version]

    async def hold(self, want: int | None, holder: str, ttl_s: float) -> int | None:
        """Pick a version as `pick_version` does (`want` if live, else the newest live one not newer) and
        keep it live, payload included, until `release(version, holder)` or `ttl_s` seconds. Replicas need
        one adapter slot more for it (`Config.adapter_slots`). None: nothing is live (the base model serves)."""
        if ttl_s <= 0:
            raise ValueError(f"hold: ttl_s must be > 0, got {ttl_s}")
        version = pick_version(self._live, want)
        if version is not None:
            self._holds[(version, holder)] = time.monotonic() + ttl_s
        return version

    async def release(self, version: int | None, holder: str) -> None:
        """End a hold; the version leaves now if it is past the rollout window."""
        if self._holds.pop((version, holder), None) is not None:
            self._expire_later(self._trim())

    async def live_versions(self) -> list[int]:
        return list(self._live)

    async def latest_version(self) -> int:
        return max(self._live) if self._live else 0

    async def retire(self, version: int) -> None:
        """Stop offering a version to new requests (the payload stays until trimmed)."""
        if version in self._live:
            self._live.remove(version)

    def _forget(self, version: int) -> None:
        self._refs.pop(version, None)
        self._meta.pop(version, None)

    def _held(self) -> set[int]:
        now = time.monotonic()
        self._holds = {key: deadline for key, deadline in self._holds.items() if deadline > now}
        return {version for version, _ in self._holds}

    def _trim(self) -> list[int]:
        """Drop the versions older than the newest `keep` that nobody holds; returns them. With keep =
        max_staleness + 1, a trimmed version is older than max_staleness for a trainer that published its
        newer ones, so its samples can only be dropped as stale."""
        window, held = set(self._live[-self._keep:]), self._held()
        out = [v for v in self._live if v not in window and v not in held]
        self._live = [v for v in self._live if v not in out]
        for version in out:
            self._forget(version)
        return out

    def _expire_later(self, versions: list[int]) -> None:
        if versions and self._ingress is not None:
            self._expiring.add(asyncio.ensure_future(self._expire(versions)))

    async def _expire(self, versions: list[int]) -> None:
        """Tell the replicas (through the ingress) to abort the rollout requests of expired versions, so
        the adapter slots they hold free up now rather than when 1,000-token completions end. Off the
        publish path; best effort (missed, they finish and are dropped as stale)."""
        try:
            out = await self._ingress.expire.remote(versions, **self._run_kwargs)
            self.expired_aborts += int(out.get("aborted", 0))
        except Exception as e:  # the ingress is being replaced: nothing is lost but the early abort
            self.expire_errors += 1
            self._last_expire_error = faults.short_error(e)
        finally:
            self._expiring.discard(asyncio.current_task())

    async def set_keep(self, keep: int) -> None:
        """How many versions stay live (max_staleness + 1); takes effect at the next publish."""
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self._keep = keep

    async def stats(self) -> dict:
        """Live versions, load retries and the expiry counters (rollouts aborted early, failed expire calls)."""
        return {"live_versions": list(self._live), "held_versions": sorted(self._held()),
                "load_retries": self.load_retries,
                "expired_aborts": self.expired_aborts, "expire_errors": self.expire_errors,
                "last_expire_error": self._last_expire_error}


REPLICA_STEPS_MS = ("add_lora_ms", "verify_ms", "evict_ms", "write_ms")  # a replica load's parts


def _slowest_replica(loaded) -> dict:
    """Where a hand-over's time went, from the ingress broadcast's answer: its own time and the slowest
    replica's (within it: the object-store fetch, the checks, an eviction, the adapter file, vLLM's add_lora)."""
    if not isinstance(loaded, dict):
        return {}
    out = {"broadcast_seconds": loaded.get("seconds")}
    slow = max((r for r in loaded.get("results") or [] if isinstance(r, dict) and r.get("seconds") is not None),
               key=lambda r: r["seconds"], default=None)
    if slow is not None:
        out.update(replica_seconds=slow["seconds"], replica_fetch_seconds=slow.get("fetch_seconds"),
                   **{f"replica_{k}": slow.get(k) for k in REPLICA_STEPS_MS})
    return {k: v for k, v in out.items() if v is not None}


def pick_version(live: list[int], want: int | None) -> int | None:
    """The version a reader of `want` gets: `want` if live; else the newest live one not newer than it (a
    step off the sync.every grid published nothing); else the newest live one; None = whatever the ingress
    serves (the base model when nothing is live)."""
    if want is None or not live:
        return live[-1] if live else None
    if want in live:
        return want
    older = [v for v in live if v <= want]
    return older[-1] if older else live[-1]


def get_or_create_registry(keep: int = 3, namespace: str = NAMESPACE, **options):
    """The named registry (in `namespace`: a fleet run's is `common.names.run_namespace(run)`); `options`
    (e.g. placement.on_driver_node()) apply when it is created here."""
    return AdapterRegistry.options(name=REGISTRY_NAME, namespace=namespace, get_if_exists=True,
                                   **options).remote(keep)


def publish_payload(registry, version: int, tensors: dict, meta: dict) -> dict:
    """Publish (tensors, meta) as `version` the trainer's way: packed into one buffer, the ObjectRef a
    top-level argument (so the registry re-puts it). Blocks until the registry answers; returns its record."""
    from common.adapter_io import pack_tensors

    return ray.get(registry.publish.remote(version, ray.put(pack_tensors(tensors)), meta))


def retire_all(registry) -> None:
    """Take every version out of the live set, so replicas started later load nothing."""
    for v in ray.get(registry.live_versions.remote()):
        ray.get(registry.retire.remote(v))
