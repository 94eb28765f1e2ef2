"""Adapter publish: gather the LoRA state dict, skip when nothing moved (a decision all ranks share),
and hand the payload to the AdapterRegistry actor (docs/ARCHITECTURE.md, "Versions and staleness").

Every rank calls `AdapterPublisher.maybe_publish` at the same steps: under ZeRO-3 the gather is a
collective, and the skip decision is an all-reduce, so no rank can run ahead into a different collective.
Only rank 0 talks to Ray."""
from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from common.adapter_io import make_meta, pack_tensors, tensors_nbytes
from common.names import NAMESPACE
from common.ray_utils import named_actor


def gather_lora_state(peft_model, zero_stage: int) -> dict[str, torch.Tensor]:
    """PEFT-named LoRA tensors as CPU copies, on every rank (collective under ZeRO-3)."""
    from peft import get_peft_model_state_dict

    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    if zero_stage == 3:
        import deepspeed

        ctx = deepspeed.zero.GatheredParameters(trainable, modifier_rank=None)
    else:
        ctx = contextlib.nullcontext()
    with ctx:
        sd = get_peft_model_state_dict(peft_model)
        return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in sd.items()}


def handover_breakdown(done) -> dict:
    """The registry's answer to a publish as row keys (`handover_*`, seconds): its own time, the ingress
    broadcast's, the slowest replica's, and within that replica's: the object-store fetch, the checks
    (verify), an eviction, the adapter file (write) and vLLM's add_lora."""
    if not isinstance(done, dict):
        return {}
    keys = {"seconds": "handover_registry_seconds", "broadcast_seconds": "handover_broadcast_seconds",
            "replica_seconds": "handover_replica_seconds", "replica_fetch_seconds": "handover_fetch_seconds"}
    out = {row: float(done[k]) for k, row in keys.items() if isinstance(done.get(k), (int, float))}
    for part in ("add_lora", "verify", "evict", "write"):
        if isinstance(done.get(f"replica_{part}_ms"), (int, float)):
            out[f"handover_{part}_seconds"] = done[f"replica_{part}_ms"] / 1000.0
    return out


def max_abs_change(new: dict[str, torch.Tensor], old: dict[str, torch.Tensor] | None) -> float:
    if old is None:
        return float("inf")
    return max(float((new[k].float() - old[k].float()).abs().max()) if new[k].numel() else 0.0 for k in new)


def _all_reduce_max(x: float, device) -> float:
    if not (dist.is_available() and dist.is_initialized()):
        return x
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


class AdapterPublisher:
    """Holds the policy version counter and the last published tensors (for the delta skip)."""

    def __init__(self, *, rank: int, zero_stage: int, mode: str, every: int, delta_threshold: float,
                 peft_config: dict, registry_name: str | None, device, start_version: int = 0,
                 base_model_dir: str | None = None, overlap: bool = False, on_served=None,
                 namespace: str = NAMESPACE):
        self.rank, self.zero_stage, self.mode = rank, zero_stage, mode
        self.every, self.delta_threshold = every, delta_threshold
        self.peft_config, self.device = peft_config, device
        self.registry = named_actor(registry_name, namespace) if rank == 0 else None
        self.version = start_version  # the trainer's policy version: optimizer steps taken
        self.served_version = 0  # the newest version the registry holds (published or tagged); 0 = base
        self._last: dict[str, torch.Tensor] | None = None
        self._base = None
        self._base_dir = base_model_dir
        # overlap: rank 0's registry calls run on one background thread, in order, at most one in flight;
        # the next publish (or flush) waits for it and re-raises its error.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="publish") if overlap and self.registry else None
        self._pending: Future | None = None
        # Rank 0, overlap: called with a version once the registry serves it (the buffer's pacing).
        self._on_served = on_served

    def resume_version(self, checkpoint_version: int) -> int:
        """Continue at max(checkpoint, registry latest) so versions stay monotonic across restarts;
        rank 0 asks the registry and every rank adopts its answer."""
        latest = 0
        if self.registry is not None:  # under plain torchrun there is no Ray (and maybe no ray package)
            import ray

            latest = int(ray.get(self.registry.latest_version.remote()))
            if latest and self._on_served is not None:
                # A restarted trainer: the buffer may have missed the callback of a publish that the
                # previous incarnation's background thread completed.
                self._on_served(latest)
        obj = [max(checkpoint_version, latest)]
        if dist.is_initialized():
            dist.broadcast_object_list(obj, src=0, device=self.device if self.device.type == "cuda" else None)
        self.version = obj[0]
        # The restored adapter is not known to be what the registry serves: the next publish step sends
        # its tensors (_last is None), never a tag.
        self.served_version = 0
        return self.version

    def maybe_publish(self, peft_model, step: int) -> dict:
        """Collective; called after every optimizer step. The policy version advances with every step,
        published or not, so pacing and staleness follow the trainer (a zero-gradient step or
        `sync.every > 1` never leaves the rollout side waiting for a version that does not come).

        - A step off the `sync.every` grid publishes nothing: replicas keep sampling the last published
          version, and its samples age against the trainer's version as they should.
        - A step whose adapter did not move (max |delta| <= threshold) tags the last published payload
          with the new version: no bytes move, and the name is true because the weights are the same.
        - Otherwise the tensors are published under the new version."""
        self.version += 1
        out = {"published": 0, "aliased": 0, "version": self.version, "served_version": self.served_version}
        if step % self.every:
            return out
        t0 = time.perf_counter()
        tensors = gather_lora_state(peft_model, self.zero_stage)
        delta = _all_reduce_max(max_abs_change(tensors, self._last), self.device)
        if delta <= self.delta_threshold and self.served_version:
            row = self._to_registry("tag", self.version, self.served_version)
            self.served_version = self.version
            return {**out, **row, "aliased": 1, "served_version": self.version, "max_delta": delta,
                    "publish_seconds": time.perf_counter() - t0}
        self._last = tensors
        row = {"adapter_bytes": tensors_nbytes(tensors)}
        if self.rank == 0 and self.registry is not None:
            row = self._to_registry("publish", self.version, tensors)
        self.served_version = self.version
        return {**out, **row, "published": 1, "served_version": self.version,
                "publish_seconds": time.perf_counter() - t0, "max_delta": delta if delta != float("inf") else -1.0}

    def _to_registry(self, what: str, version: int, arg) -> dict:
        """Rank 0: publish (tensors) or tag (of_version) `version`. Returns the row's publish keys:
        `publish_to_served_seconds` (hand-over to every replica serving it) of the call that finished
        here, and with overlap `publish_blocked_seconds` (the trainer waiting for the previous call)."""
        if self.rank != 0 or self.registry is None:
            return {}
        call = self._publish if what == "publish" else self._tag
        if self._pool is None:
            return call(version, arg)
        row = self.flush()
        self._pending = self._pool.submit(self._call_then_tell, call, version, arg)
        return {**row, "served_pending": 1}

    def _call_then_tell(self, call, version: int, arg) -> dict:
        out = call(version, arg)
        if self._on_served is not None:
            self._on_served(version)
        return out

    def flush(self) -> dict:
        """Wait for the background registry call (if any); its error is raised here."""
        if self._pending is None:
            return {}
        t0 = time.perf_counter()
        fut, self._pending = self._pending, None
        done = fut.result()
        return {**done, "publish_blocked_seconds": time.perf_counter() - t0}

    def _tag(self, version: int, of_version: int) -> dict:
        import ray

        t0 = time.perf_counter()
        ray.get(self.registry.tag.remote(version, of_version))
        return {"publish_to_served_seconds": time.perf_counter() - t0}

    def _publish(self, version: int, lora: dict[str, torch.Tensor]) -> dict:
        import ray

        if self.mode == "merge":
            from train_loops.merge import load_base_state, lora_pairs, merged_state

            if self._base is None:  # base weights are frozen: the files on disk are the live weights
                self._base = load_base_state(self._base_dir)
            payload = merged_state(self._base, lora_pairs(lora, self.peft_config))
            meta = make_meta(payload, None, kind="merged")
        else:
            payload = lora
            meta = make_meta(payload, self.peft_config, kind="adapter")
        t0 = time.perf_counter()
        ref = ray.put(pack_tensors(payload))
        done = ray.get(self.registry.publish.remote(version, ref, meta))
        return {"adapter_bytes": tensors_nbytes(payload), "publish_to_served_seconds": time.perf_counter() - t0,
                **handover_breakdown(done)}
