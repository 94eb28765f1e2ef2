"""The per-worker GRPO loop. Runs under Ray Train's TorchTrainer (runner "ray") and under plain
torchrun (runner "torchrun": `python -m torch.distributed.run --nproc_per_node N -m train_loops.worker
LOOP_CFG.json`), the second for fast tests without Ray.

loop_cfg keys:
  config          Config.to_dict()
  batch_source    "buffer" (rank 0 pulls from the RolloutBuffer actor and broadcasts) | "synthetic"
                  (a pure function of (seed, step): tests and benchmarks)
  registry_name   AdapterRegistry actor name (publish only when given and Ray is initialised)
  metrics_name    RunMetrics actor name (per-step rows from rank 0)
  resume_from     checkpoint directory (a Ray Train restart's own checkpoint takes precedence)
  runner          "ray" (default) | "torchrun"
  checkpoint_dir  torchrun only: where checkpoint_<step> directories go
  ds_overrides    dict merged into the DeepSpeed config
  dump_dir        tests/debugging: rank 0 writes steps.jsonl and the final full weights (full_state.safetensors)
  synthetic       {"prompt_len": P, "completion_len": C}: fixed synthetic lengths (speed benchmarks)
  profile_step    N: rank 0 runs step N under torch.profiler and writes its top ops to dump_dir/profile.txt
  fail_once_at    THE test hook for fault injection (tests and benchmarks only; the only one in the loop):
                  {"step": N, "rank": R, "marker": path}: that rank dies (os._exit) at the start of step N
                  once (the marker file remembers), to exercise Ray Train's restore-from-checkpoint.
                  Faults can also come from outside: benchmarks/bench_reliability.py SIGKILLs a train
                  worker's process instead.

The data cursor (common/data_cursor.py): with batch_source "buffer", `state["data"]` records per data
epoch the prompt ids the trained steps used (and groups dynamic sampling filtered); it is saved in every
checkpoint, a restore hands the buffer back what later (lost) steps took (`RolloutBuffer.rewind`), and
each step's row carries its prompts (`prompts`, "epoch:id") and `prompt_repeats` (must stay 0).
Stop: the driver's Ctrl-C sets the buffer's stop flag; after the step in progress the loop checkpoints
and ends (every rank agrees through a broadcast).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from common.config import Config, from_dict, validate
from common.data_cursor import ConsumedPrompts, parse_prompt_key, prompt_key
from train_loops import checkpoint as ckpt
from train_loops.batches import BUFFER_NAME, StepBatch, buffer_batch, collate, synthetic_batch
from train_loops.losses import get_policy_loss

_MAX_KEYS = ("log_ratio_abs_max",)
_SUM_KEYS = ("tokens", "seq_tokens", "padded_tokens")


def train_loop_per_worker(loop_cfg: dict) -> None:
    cfg = from_dict(loop_cfg["config"])
    validate(cfg)
    from train_loops.deepspeed_setup import prepare_env

    prepare_env(cfg.train.use_gpu)  # before anything imports deepspeed
    GRPOWorker(cfg, loop_cfg).train()


class GRPOWorker:
    def __init__(self, cfg: Config, loop_cfg: dict):
        from common.ray_utils import named_actor
        from train_loops.adapter_sync import AdapterPublisher
        from train_loops.deepspeed_setup import build_engine, init_distributed
        from train_loops.lora import build_lora_model, peft_config_dict
        from train_loops.policy import PolicyLogprobs

        self.cfg, self.loop_cfg = cfg, loop_cfg
        self.runner = loop_cfg.get("runner", "ray")
        self.source = loop_cfg.get("batch_source", "buffer")
        if self.source not in ("buffer", "synthetic"):
            raise ValueError(f"batch_source {self.source!r} is not buffer or synthetic")
        init_distributed(cfg.train.use_gpu)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = self._device()
        torch.manual_seed(cfg.train.seed)

        self.model = build_lora_model(cfg)
        self.peft_config = peft_config_dict(self.model)
        self.policy_loss = get_policy_loss(cfg.grpo.loss)
        self.pad_id = self.model.config.pad_token_id or 0
        self.vocab = self.model.config.vocab_size
        # ZeRO-3 gathers the LM head at every chunk (and again in each chunk's recompute): ranks whose
        # micro-batches hold different token counts would run different numbers of collectives and
        # deadlock, so under ZeRO-3 (CPU only: refused on GPU) the head runs once per forward.
        chunk = cfg.train.logprob_chunk if cfg.train.zero_stage < 3 else 1 << 62
        policy = PolicyLogprobs(self.model, chunk, cfg.grpo.temperature)
        self.engine = build_engine(policy, cfg, self.world, loop_cfg.get("ds_overrides"))
        self.metrics = named_actor(loop_cfg.get("metrics_name")) if self.rank == 0 else None
        self.publisher = AdapterPublisher(
            rank=self.rank, zero_stage=cfg.train.zero_stage, mode=cfg.sync.mode, every=cfg.sync.every,
            delta_threshold=cfg.sync.delta_threshold, peft_config=self.peft_config,
            registry_name=loop_cfg.get("registry_name"), device=self.device, base_model_dir=cfg.model.path,
            overlap=cfg.sync.overlap_publish and cfg.run.mode == "async", on_served=self._buffer_served())
        self.token_budget = self._token_budget()
        self.info = {"liger_kernels": getattr(self.model, "liger_kernels", "off"), "fused_lora": cfg.train.fused_lora,
                     "max_tokens_per_micro_batch": self.token_budget, "device": str(self.device)}
        if self.rank == 0:
            print("trainer: " + ", ".join(f"{k} {v}" for k, v in self.info.items()), flush=True)
            if loop_cfg.get("dump_dir"):
                d = Path(loop_cfg["dump_dir"])
                d.mkdir(parents=True, exist_ok=True)
                (d / "trainer_info.json").write_text(json.dumps(self.info))
        self.state = {"step": 0, "version": 0, "consumed_groups": 0}
        self._restore()
        self.consumed = ConsumedPrompts.from_state(self.state.get("data"))
        self._rewind_buffer()
        self.publisher.resume_version(self.state["version"])

    # ------------------------------------------------------------------ the loop

    def train(self) -> None:
        total = self.cfg.train.total_steps
        every = self.cfg.checkpoint.every
        row = {}
        for step in range(self.state["step"] + 1, total + 1):
            self._maybe_fail(step)
            row = self._profiled_step(step) if step == self.loop_cfg.get("profile_step") else self.step(step)
            saved = (every and step % every == 0) or step == total
            if saved:
                self.save_checkpoint(step, row)
            if step < total and self._stop_requested():
                if not saved:
                    self.save_checkpoint(step, row)
                break
        self.publisher.flush()  # the last version is served before the run reports done
        self._dump_final()

    def step(self, step: int) -> dict:
        """batch -> logprobs -> (ref logprobs) -> loss -> backward -> step -> publish -> report."""
        t0 = time.perf_counter()
        batch = self.next_batch(step)
        t1 = time.perf_counter()
        stats = self.learn(batch.samples)
        t2 = time.perf_counter()
        pub = self.publisher.maybe_publish(self.model, step)
        pending = pub.pop("served_pending", 0)
        prompts = self._record_prompts(batch)
        self.state.update(step=step, version=self.publisher.version,
                          consumed_groups=self.state["consumed_groups"] + len(batch.groups))
        if self.rank == 0 and self.source == "buffer":
            from common.ray_utils import named_actor

            # Every step: drops stale groups early and, once the version is served (at once unless its
            # publish runs in the background: then the publisher's on_served), frees generation slots.
            named_actor(BUFFER_NAME).set_trainer_version.remote(pub["version"], ready=not pending)
        reward_mean, reward_std = batch.reward_stats()
        row = {**stats, **pub, "step_seconds": time.perf_counter() - t0, "batch_wait_seconds": t1 - t0,
               "learn_seconds": t2 - t1, "train_tokens_per_s": stats["seq_tokens"] / max(t2 - t1, 1e-9),
               "staleness_mean": batch.staleness_mean, "staleness_max": batch.staleness_max,
               "dropped_samples": batch.dropped_samples, "reward_mean": reward_mean, "reward_std": reward_std,
               **prompts}
        if self.device.type == "cuda":
            row["peak_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.report(step, row)
        return row

    def _buffer_served(self):
        """Rank 0 with the buffer: the callback that tells it a version is served (overlapped publish)."""
        if self.rank != 0 or self.source != "buffer":
            return None
        from common.ray_utils import named_actor

        buffer = named_actor(BUFFER_NAME)
        return None if buffer is None else (lambda v: buffer.mark_ready.remote(v))

    def _profiled_step(self, step: int) -> dict:
        """One step under torch.profiler; rank 0 writes the top ops by self time (the speed work's
        "where the time goes") to dump_dir/profile.txt."""
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            row = self.step(step)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        if self.rank == 0 and self.loop_cfg.get("dump_dir"):
            key = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
            table = prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60)
            d = Path(self.loop_cfg["dump_dir"])
            d.mkdir(parents=True, exist_ok=True)
            (d / "profile.txt").write_text(f"step {step}, sorted by {key}\n{table}\n")
        return row

    def next_batch(self, step: int) -> StepBatch:
        g = self.cfg.grpo
        if self.source == "synthetic":
            return synthetic_batch(self.cfg.train.seed, step, g.prompts_per_step, g.group_size, self.vocab,
                                   g.max_new_tokens, self.cfg.scale_advantages, **self.loop_cfg.get("synthetic", {}))
        obj = [buffer_batch(self.publisher.version, g.prompts_per_step) if self.rank == 0 else None]
        dist.broadcast_object_list(obj, src=0, device=self._obj_device())
        return obj[0]

    def learn(self, batch_samples: list) -> dict:
        """One optimizer step over the step's samples: this rank's share, cut into micro-batches by the
        token budget (train_loops.micro_batches), every rank running the same number of backwards."""
        from train_loops import micro_batches as mb

        g = self.cfg.grpo
        ranks = mb.assign_ranks(batch_samples, self.world)
        n_micro = mb.micro_batches_needed(ranks, self.token_budget)
        micro = mb.plan(ranks, self.rank, self.token_budget, n_micro)
        token_denom, seq_denom = mb.step_denominators(ranks)
        current = self.publisher.version  # the version the weights being trained hold now
        micro_stats = []
        for i in range(n_micro):
            # A rank with fewer sequences than the others' micro-batch count repeats one with weight 0:
            # its backward must still run, or the ZeRO reductions of the ranks go out of step.
            part, weight = (micro[i], 1.0) if i < len(micro) else (micro[-1][:1], 0.0)
            b = collate(part, self.pad_id, self.device)
            fwd = {k: b[k] for k in ("input_ids", "attention_mask", "pred_pos", "targets", "mask")}
            logp, entropy = self.engine(**fwd)
            ref = None
            if g.kl_coef > 0:
                with torch.no_grad():
                    ref, _ = self.engine(**fwd, disable_adapter=True)
            loss, st = self._loss(logp, b, ref, entropy, token_denom, seq_denom)
            self.engine.set_gradient_accumulation_boundary(i == n_micro - 1)
            self.engine.backward(loss * weight, scale_wrt_gas=False)
            self.engine.step()  # applies the update only at the boundary
            if weight:
                st.update(_fresh_log_ratio(logp, b, part, current))
                micro_stats.append({**st, "loss": float(loss.detach()),
                                    "seq_tokens": int(b["attention_mask"].sum()),
                                    "padded_tokens": int(b["attention_mask"].numel())})
        stats = _combine(micro_stats)
        stats["loss"] *= len(micro_stats)  # micro-batch losses are shares of the step's loss: sum them
        stats["micro_batches"] = n_micro
        grad_norm = self.engine.get_global_grad_norm()
        stats["grad_norm"] = float(grad_norm) if grad_norm is not None else 0.0
        return stats

    def _loss(self, logp, b: dict, ref, entropy, token_denom: float, seq_denom: float):
        return self.policy_loss(logp, b["behaviour_logp"], b["mask"], b["advantages"], opts=self.cfg.grpo,
                                ref_logp=ref, entropy=entropy, token_denominator=token_denom,
                                seq_denominator=seq_denom)

    def _token_budget(self) -> int:
        """train.max_tokens_per_micro_batch, or the automatic one agreed by all ranks (the smallest)."""
        from train_loops.fused_kernels import liger_applied
        from train_loops.micro_batches import auto_budget

        t = self.cfg.train
        if t.max_tokens_per_micro_batch is not None:
            return t.max_tokens_per_micro_batch
        dtype_bytes = 4 if self.cfg.torch_dtype == "float32" else 2
        liger = liger_applied(getattr(self.model, "liger_kernels", "off"))
        mine = auto_budget(self.model.config, self.device, dtype_bytes, t.gradient_checkpointing,
                           self.cfg.model.max_model_len, t.logprob_chunk, liger=liger)
        v = torch.tensor([mine], dtype=torch.int64, device=self.device)
        dist.all_reduce(v, op=dist.ReduceOp.MIN)
        return int(v.item())

    # ------------------------------------------------------------------ reporting, checkpoints

    def report(self, step: int, row: dict) -> None:
        """Average the per-rank stats, then rank 0 logs one row (RunMetrics actor and/or dump_dir)."""
        rows = [None] * self.world
        dist.all_gather_object(rows, row)
        if self.rank != 0:
            return
        merged = {**row, **_combine([{k: r[k] for k in r if k in _STAT_KEYS} for r in rows])}
        merged["train_tokens_per_s"] = merged["seq_tokens"] / max(max(r["learn_seconds"] for r in rows), 1e-9)
        if self.metrics is not None:
            self.metrics.log_train.remote(step, merged)
        if self.loop_cfg.get("dump_dir"):
            d = Path(self.loop_cfg["dump_dir"])
            d.mkdir(parents=True, exist_ok=True)
            with (d / "steps.jsonl").open("a") as f:
                f.write(json.dumps({"step": step, **merged}) + "\n")

    def save_checkpoint(self, step: int, row: dict) -> None:
        # A checkpoint's version is one the registry holds: a resume republishes from a consistent state.
        self.publisher.flush()
        from train_loops.adapter_sync import gather_lora_state

        lora = gather_lora_state(self.model, self.cfg.train.zero_stage)
        name = f"checkpoint_{step:06d}"
        if self.runner == "torchrun":
            parent = Path(self.loop_cfg.get("checkpoint_dir") or self.cfg.run_dir / "checkpoints")
            ckpt.save(self.engine, parent / name, rank=self.rank, state=self.state, lora=lora,
                      peft_config=self.peft_config)
            if self.rank == 0:
                ckpt.trim(parent, self.cfg.checkpoint.keep)
            return
        import ray.train

        d = tempfile.mkdtemp(prefix="grpo-ckpt-")
        try:
            ckpt.save(self.engine, d, rank=self.rank, state=self.state, lora=lora, peft_config=self.peft_config)
            metrics = {k: v for k, v in row.items() if isinstance(v, (int, float))}
            ray.train.report({**metrics, "step": step, "version": self.state["version"]},
                             checkpoint=ray.train.Checkpoint.from_directory(d), checkpoint_dir_name=name)
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def _restore(self) -> None:
        """A Ray Train restart's own checkpoint first (failure recovery), else loop_cfg resume_from."""
        if self.runner == "ray":
            import ray.train

            c = ray.train.get_checkpoint()
            if c is not None:
                with c.as_directory() as d:
                    self.state = ckpt.load(self.engine, d, rank=self.rank)
                return
        path = self.loop_cfg.get("resume_from") or self.cfg.checkpoint.resume_from
        if path:
            self.state = ckpt.load(self.engine, path, rank=self.rank)

    def _record_prompts(self, batch: StepBatch) -> dict:
        """The data cursor's trainer half: this step's prompts (and the groups filtered since the last
        step) join the record the next checkpoint saves. Returns the row's `prompts`/`prompt_repeats`."""
        if self.source != "buffer":
            return {}
        keys = [prompt_key(g.epoch, g.prompt_id) for g in batch.groups]
        for k in [*keys, *batch.filtered]:
            self.consumed.add(*parse_prompt_key(k))
        self.state["data"] = self.consumed.to_state()
        return {"prompts": keys, **({"prompts_filtered": list(batch.filtered)} if batch.filtered else {}),
                "prompt_repeats": self.consumed.repeats}

    def _buffer(self):
        """Rank 0's handle on the RolloutBuffer actor, or None (no Ray, no buffer: trainer-only tests)."""
        if self.rank != 0 or self.source != "buffer":
            return None
        from common.ray_utils import named_actor

        try:
            return named_actor(BUFFER_NAME)
        except ValueError:
            return None

    def _rewind_buffer(self) -> None:
        """After a restore: prompts the buffer handed to steps this checkpoint does not hold (they died
        with the failed workers) are handed out again. A no-op on a fresh start or a driver resume."""
        buf = self._buffer()
        if buf is not None:
            import ray

            ray.get(buf.rewind.remote(self.consumed.to_state()))

    def _stop_requested(self) -> bool:
        """Collective: rank 0 asks the buffer whether the driver asked to stop; every rank gets the answer."""
        if self.source != "buffer":  # every rank knows: no buffer, no stop request, no collective
            return False
        flag = False
        buf = self._buffer()
        if buf is not None:
            import ray

            try:
                flag = bool(ray.get(buf.stop_requested.remote(), timeout=30))
            except Exception:  # a buffer that cannot answer asked for nothing
                flag = False
        obj = [flag]
        if dist.is_initialized() and self.world > 1:
            dist.broadcast_object_list(obj, src=0, device=self._obj_device())
        return bool(obj[0])

    def _maybe_fail(self, step: int) -> None:
        """The test hook `fail_once_at` (see the module docstring): tests and benchmarks only."""
        f = self.loop_cfg.get("fail_once_at")
        if f and step == f["step"] and self.rank == f["rank"] and not Path(f["marker"]).exists():
            Path(f["marker"]).touch()
            os._exit(1)  # like a killed process: no exception handling, no cleanup

    def _dump_final(self) -> None:
        """Tests: the trainer's full final weights (base + LoRA, PEFT names) from rank 0."""
        if not self.loop_cfg.get("dump_dir"):
            return
        import contextlib

        params = list(self.model.parameters())
        ctx = contextlib.nullcontext()
        if self.cfg.train.zero_stage == 3:
            import deepspeed

            ctx = deepspeed.zero.GatheredParameters(params, modifier_rank=None)
        with ctx:
            full = {n: p.detach().to("cpu", copy=True).contiguous() for n, p in self.model.named_parameters()}
        if self.rank == 0:
            from safetensors.torch import save_file

            save_file(full, str(Path(self.loop_cfg["dump_dir"]) / "full_state.safetensors"))
        dist.barrier()

    def _device(self) -> torch.device:
        if not self.cfg.train.use_gpu:
            return torch.device("cpu")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if self.runner == "ray":
            import ray.train

            local = ray.train.get_context().get_local_rank()
        torch.cuda.set_device(local)
        return torch.device("cuda", local)

    def _obj_device(self):
        return self.device if self.device.type == "cuda" else None


_STAT_KEYS = ("loss", "kl", "clip_frac", "entropy", "log_ratio_abs_mean", "log_ratio_abs_max", "tokens",
              "seq_tokens", "padded_tokens", "grad_norm", "tis_weight_mean", "tis_clip_frac", "micro_batches",
              "is_weight_mean", "seq_log_ratio_abs_mean", "log_ratio_fresh")


def _fresh_log_ratio(logp, b: dict, part: list, current: int) -> dict:
    """Mean |trainer - vLLM| logprob over the tokens of samples the current weights generated: the
    engines' numerical mismatch alone, without the policy drift that staler samples add."""
    fresh = torch.tensor([s.version == current for s in part], device=logp.device)
    sel = b["mask"] & fresh[:, None]
    if not bool(sel.any()):
        return {}
    return {"log_ratio_fresh": float((logp.detach().float() - b["behaviour_logp"]).abs()[sel].mean())}


def _combine(stats: list[dict]) -> dict:
    """Mean over micro-batches / ranks (of those that have the key), max for maxima, sum for counts."""
    out = {}
    for k in dict.fromkeys(k for s in stats for k in s):
        vals = [s[k] for s in stats if k in s]
        out[k] = max(vals) if k in _MAX_KEYS else sum(vals) if k in _SUM_KEYS else sum(vals) / len(vals)
    return out


def main(argv: list[str] | None = None) -> int:
    """torchrun entry: the one argument is a JSON file holding loop_cfg."""
    argv = sys.argv[1:] if argv is None else argv
    loop_cfg = json.loads(Path(argv[0]).read_text())
    loop_cfg["runner"] = "torchrun"
    train_loop_per_worker(loop_cfg)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
