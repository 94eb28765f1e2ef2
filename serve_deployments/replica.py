"""RolloutReplica: one Ray Serve replica running one vLLM engine with LoRA adapters.

Protocol (docs/ARCHITECTURE.md, "Versions and staleness" and "Serving"), this replica's side:
- Adapters arrive by version from the AdapterRegistry, are verified (digest, shapes against the base
  model) and written as PEFT dirs on tmpfs, then `add_lora`-ed before any request names them.
- Start/restart: every live version is loaded before Serve marks the replica healthy.
- A request holds its version's slot until its last token; eviction only takes idle versions.
- A version the replica lacks is loaded on demand from the registry, else the request fails clearly;
  a policy name is never served by the base model.
- Merge mode: `update_weights(N)` reloads full weights in place; the base model then IS policy-vN and
  older versions fail clearly.

Runs (docs/FLEET.md): an adapter is `(run, version)`. The standalone service is the run "", whose registry
is the constructor's, and every call without a run means what it always meant. On a fleet (`fleet=NAME`)
the replica serves several runs' adapters side by side, named `RUN/policy-vN`:
- each run's registry is its own (`REGISTRY_NAME` in `run_namespace(RUN)`), looked up when first needed and
  looked up again after a failed call (a run that ended takes its registry with it);
- each run fills at most its quota of the adapter slots and evicts only its own versions (adapter_slots.py);
  at start the replica asks the fleet's FleetState for the attached runs, sets their quotas and loads their
  live versions; the run "" gets no slots on a fleet (the attached runs own them);
- `forget_run(RUN)` (the run detached or its lease ran out) aborts its rollouts, unloads its adapters and
  drops its quota, digests and registry handle, touching no other run's slot;
- merge mode stays the run ""'s: a fleet run's version is never the base weights.

This module only wires; each role is its own object:
- the engine and vLLM's OpenAI serving classes over it: vllm_engine.py, both injected (`engine_factory`,
  `serving_factory`; tests/support/fake_engine.py runs the replica without vLLM);
- the runs' registries and the fleet's attached runs: replica_registries.py (`actors` injected);
- adapters by run, quotas, loads, admission (`hold`): replica_adapters.py, over adapter_slots.py and the
  weight transports of engine_weights.py; merge mode: replica_merge.py;
- the rollout path (`generate`, `generate_n`): replica_rollout.py; the OpenAI path: replica_openai.py;
- the replica's own REST port: replica_http.py.

All methods are async and run on Serve's user event loop, so bookkeeping between awaits is atomic.
"""
from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable

from ray import serve

from serve_deployments.adapter_files import BaseModelShapes, remove_dir, scratch_root
from serve_deployments.adapter_slots import AdapterSlots
from serve_deployments.engine_weights import AdapterTransport, MergedTransport, ReplicaError
from serve_deployments.replica_adapters import ReplicaAdapters, VersionExpiredError
from serve_deployments.replica_merge import update_weights
from serve_deployments.replica_openai import OpenAIPath, error_dict
from serve_deployments.replica_registries import RunRegistries
from serve_deployments.replica_rollout import RolloutPath, check_seed
from serve_deployments.vllm_engine import PrefixCacheCounter, VllmServing, build_engine, resolve

__all__ = ["Replica", "ReplicaError", "RolloutReplica", "VersionExpiredError", "error_dict"]

log = logging.getLogger("ray.serve")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


class Replica:
    """The replica's objects, wired. `start()` loads the live versions (and opens the REST port); the Serve
    deployment below does both in its constructor, a unit test calls them itself.

    `engine_factory(engine, replica_id, prefix_counter)` -> the engine; `serving_factory(engine, model,
    tool_parser)` -> the OpenAI serving handlers; `actors(name, namespace)` -> a named actor's methods, awaited
    directly (replica_registries.py). Each may be a callable, `"module:name"`, or None for the real one."""

    def __init__(self, engine: dict, registry_name: str | None, registry_namespace: str, max_loras: int,
                 tool_parser: str | None = None, fleet: str | None = None, stream_interval_ms: float = 0.0,
                 http: dict | None = None, engine_factory: str | Callable | None = None,
                 serving_factory: str | Callable | None = None, actors: str | Callable | None = None):
        self._t0 = time.perf_counter()
        if tool_parser is not None:  # a misspelt rollout.tool_parser fails before the engine starts
            from serve_deployments.tool_parsers import check_tool_parser

            check_tool_parser(tool_parser)
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # constructed outside Serve (unit use)
            self.replica_id = uuid.uuid4().hex[:8]
        self._fleet, self._http_options, self._http = fleet, http, None
        # The run ""'s registry is looked up now on a standalone replica (a missing one fails the start),
        # lazily on a fleet.
        self.registries = RunRegistries((registry_name, registry_namespace) if registry_name else None, fleet,
                                        resolve(actors, None))
        if not fleet:
            self.registries.handle("")
        self._model = engine["model"]
        self._max_loras = max_loras
        self._prefix = PrefixCacheCounter()
        self.engine = resolve(engine_factory, build_engine)(engine, self.replica_id, self._prefix)
        self.block_size = int(self.engine.vllm_config.cache_config.block_size)
        self.max_model_len = int(self.engine.model_config.max_model_len)
        self.engine_start_s = time.perf_counter() - self._t0

        shapes = BaseModelShapes(self._model)
        self._scratch = scratch_root(f"replica-{self.replica_id}")
        serving = resolve(serving_factory, VllmServing)(self.engine, self._model, tool_parser)
        # The adapters' LoRA requests live in the serving handlers' model registry, where they look names up.
        transport = AdapterTransport(self.engine, AdapterSlots(max_loras), shapes, self._scratch,
                                     int(engine.get("max_lora_rank", 16)), requests=serving.lora_requests)
        merged = MergedTransport(self.engine, shapes, self._scratch)
        self.adapters = ReplicaAdapters(transport.slots, transport, merged, self.registries, self.replica_id)
        on_cpu = not _has_cuda()
        self.rollout = RolloutPath(self.engine, self.adapters, self.replica_id, on_cpu)
        self.openai_path = OpenAIPath(serving, self.adapters, self._model, self.replica_id,
                                      lambda seed: check_seed(seed, on_cpu), float(stream_interval_ms) / 1000.0)

    async def start(self) -> None:
        """Serve the live versions (a fleet's: every attached run's), then open the REST port if asked."""
        if self._fleet:
            await self.adapters.join_fleet()
        else:
            await self.adapters.load_live("", self.update_weights)
        if self._http_options:
            self._start_http(**self._http_options)
        log.info("replica %s ready in %.1fs (engine %.1fs), adapters %s, block size %d%s", self.replica_id,
                 time.perf_counter() - self._t0, self.engine_start_s, [k.name for k in self._slots.keys()],
                 self.block_size, f", REST on {self._http.url}" if self._http else "")

    def _start_http(self, host: str, port: int, max_inflight: int, max_body_bytes: int) -> None:
        """The OpenAI routes on this replica's own port (replica_http.py), once it serves its live versions."""
        import ray
        from transformers import AutoTokenizer

        from common.names import NAMESPACE, fleet_app
        from serve_deployments.fleet_access import FleetAccess
        from serve_deployments.openai_body import add_scrub_roots
        from serve_deployments.replica_http import ReplicaHttp, bind_socket, build_app

        access = (FleetAccess(lambda: ray.get_actor(fleet_app(self._fleet), namespace=NAMESPACE))
                  if self._fleet else None)
        add_scrub_roots(str(self._model).rstrip("/"), os.path.realpath(self._model))
        app = build_app(self, AutoTokenizer.from_pretrained(self._model), max_inflight, max_body_bytes, access)
        public = ray.util.get_node_ip_address() if host in ("0.0.0.0", "::") else host
        self._http = ReplicaHttp(app, bind_socket(host, int(port)), public)

    # What replica_http.py reads of the replica (its ReplicaRuns and local registry).
    @property
    def _slots(self) -> AdapterSlots:
        return self.adapters.slots

    @property
    def _base_version(self) -> int:
        return self.adapters.base_version

    async def _live(self, run: str, cached: bool = False) -> list[int]:
        return await self.registries.live(run, cached)

    async def _registry_call(self, run: str, method: str, *args):
        return await self.registries.call(run, method, *args)

    # ------------------------------------------------------------------ runs and adapters

    async def set_quota(self, run: str, slots: int) -> dict:
        """How many adapter slots run `run` may fill on this replica (the ingress broadcasts it when a run
        attaches). Nothing is evicted at once (adapter_slots.py)."""
        return self.adapters.set_quota(run, slots)

    async def forget_run(self, run: str, timeout_s: float = 30.0) -> dict:
        """Run `run` left the fleet: abort its rollout requests (as `expire`), wait up to `timeout_s` for its
        other requests, unload every adapter of it and drop its quota, digests and registry handle. Still
        busy after the wait: ReplicaError 409 and nothing is unloaded (the caller tries again). No other
        run's slot is touched. Returns {"run", "unloaded": [versions], "aborted": n}."""
        return await self.adapters.forget_run(run, timeout_s)

    async def load_adapter(self, version: int, run: str = "") -> dict:
        """Fetch, verify, write and `add_lora` run `run`'s version; idempotent. On a bad payload raises
        ReplicaError and leaves every loaded adapter serving."""
        return await self.adapters.load(version, run)

    async def unload_adapter(self, version: int, run: str = "", timeout_s: float = 600.0) -> bool:
        """Drop run `run`'s version: new requests for it are refused at once, in-flight ones finish first.
        False if it was not loaded."""
        return await self.adapters.unload(version, run, timeout_s)

    async def expire(self, versions: list[int], run: str = "") -> int:
        """Run `run`'s registry trimmed these versions (older than every live one): their rollout requests
        (`drop_if_expired`) are aborted and new ones refused; REST and eval requests finish as usual.
        Returns the number of requests aborted."""
        return self.adapters.expire(versions, run)

    async def update_weights(self, version: int) -> dict:
        """Merge mode: make policy-vN's merged full weights the engine's base weights."""
        return await update_weights(self.adapters, version)

    # ------------------------------------------------------------------ generation

    async def generate(self, req: dict) -> dict:
        """Token ids in, sampled token ids + per-token behaviour logprobs out (rollout path, replica_rollout.py).

        `req["drop_if_expired"]` (the rollout workers set it): when the version expires while this
        request runs (`expire`), the request is aborted in the engine and VersionExpiredError raised; its
        samples could only be dropped as too stale to train on. `req["run"]`: the fleet run whose version it
        is ("" or absent: the standalone run)."""
        return await self.rollout.generate(req)

    async def generate_n(self, req: dict, n: int) -> list[dict]:
        """n samples of one request (a GRPO group) in one call: what `generate` returns, n times. The
        samples run concurrently in the engine and share the prompt's cached blocks; the first one to fail
        cancels the others (their engine requests are aborted) and its error is raised."""
        return await self.rollout.generate_n(req, n)

    async def openai(self, path: str, body: dict) -> dict:
        """Non-streaming OpenAI completion / chat completion; errors come back as a dict."""
        return await self.openai_path.openai(path, body)

    async def openai_stream(self, path: str, body: dict):
        """Streaming variant: yields SSE lines (`data: {...}\\n\\n`, last `data: [DONE]\\n\\n`); after the first,
        those of each `stream_interval_ms` joined into one message (stream_batch.py)."""
        async for text in self.openai_path.stream(path, body):
            yield text

    def _openai_events(self, path: str, body: dict):
        """openai_stream unbatched (the replica's own REST port: no hop to batch for)."""
        return self.openai_path.events(path, body)

    # ------------------------------------------------------------------ control and introspection

    async def pause(self) -> None:
        """Hold generation: running requests freeze, new ones queue, until resume()."""
        await self.engine.pause_generation(mode="keep", clear_cache=False)

    async def resume(self) -> None:
        await self.engine.resume_generation()

    async def stats(self) -> dict:
        """`versions`, `inflight_by_version`, `rejected`, `expired`: the run ""'s, by version (as before runs);
        `adapters`, `inflight_by_adapter`, `rejected_adapters`: every run's, by adapter name; `quotas`: the
        runs' slots (the run "" listed only when set: otherwise it has them all); `partial`: partial rollout segments
        running, continuations among them, moves so far (partial_rollouts.py); `merge_pending`: the merged-weights
        update in progress and its step (replica_merge.py), None between updates."""
        a = self.adapters
        slots = a.slots
        return {"replica_id": self.replica_id, "ongoing": slots.ongoing(), "versions": slots.versions(),
                "inflight_by_version": {k.version: n for k, n in slots.inflight.items() if not k.run},
                "adapters": sorted(k.name for k in slots.keys()),
                "inflight_by_adapter": {k.name: n for k, n in slots.inflight.items()},
                "quotas": slots.quotas(), "fleet": self._fleet,
                "prefix_cache_hits": self._prefix.hits,
                "prefix_cache_queries": self._prefix.queries, "block_size": self.block_size,
                "base_version": a.base_version, "merge_pending": a.merged.pending,
                "engine_start_s": self.engine_start_s,
                "add_lora_ms": list(a.transport.add_lora_ms[-16:]),
                "rejected": {k.version: m for k, m in a.rejected.items() if not k.run},
                "rejected_adapters": {k.name: m for k, m in a.rejected.items()},
                "expired": sorted(k.version for k in a.expired if not k.run),
                "aborted_expired": a.aborted_expired, "partial": a.partial.stats(), "pid": os.getpid(),
                "http_url": self._http.url if self._http else None}

    async def engine_info(self) -> dict:
        return {"block_size": self.block_size, "max_model_len": self.max_model_len, "model": self._model,
                "max_loras": self._max_loras}

    async def check_health(self) -> None:
        """Serve restarts the replica when the engine died (e.g. an error inside a step)."""
        await self.engine.check_health()

    def __del__(self):
        if getattr(self, "_http", None) is not None:
            self._http.stop()
        if getattr(self, "_scratch", None) is not None:
            remove_dir(self._scratch)
        engine = getattr(self, "engine", None)
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # interpreter teardown: vLLM's own cleanup may find modules gone
                pass


@serve.deployment
class RolloutReplica(Replica):
    """The Serve deployment: a Replica started in its constructor, so Serve marks it healthy only once it
    serves its live versions."""

    async def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        await self.start()
