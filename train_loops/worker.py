"""The per-worker GRPO loop, run by Ray Train's TorchTrainer (train_loops/trainer.py). Rank 0 pulls each
step's groups from the RolloutBuffer actor and broadcasts them; checkpoints go through `ray.train.report`.
(train_loops/harness.py runs the same worker on synthetic batches, under torchrun or Ray Train, for tests
and the speed benchmarks.)

What a worker runs is the typed `Config` plus `WorkerOptions` (a checkpoint to start from, the actors it
talks to, DeepSpeed overrides). `cfg.train.profile_step` runs one step under torch.profiler
(RUN_DIR/profile.txt).

The data cursor (common/data_cursor.py): `state["data"]` records per data epoch the prompt ids the
trained steps used (and groups dynamic sampling filtered); it is saved in every
checkpoint, a restore hands the buffer back what later (lost) steps took (`RolloutBuffer.rewind`), and
each step's row carries its prompts (`prompts`, "epoch:id") and `prompt_repeats` (must stay 0).
Stop: the driver's Ctrl-C sets the buffer's stop flag; after the step in progress the loop checkpoints
and ends (every rank agrees through a broadcast).
"""
from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.distributed as dist

from common.config import Config, from_dict, validate
from common.data_cursor import ConsumedPrompts, parse_prompt_key, prompt_key
from common.names import BUFFER_NAME, METRICS_NAME, REGISTRY_NAME
from train_loops import checkpoint as ckpt
from train_loops.batches import RunClosed, StepBatch, buffer_batch, collate
from train_loops.behaviour import VersionWeights, fill_from_forward, prepass, scoreable
from train_loops.losses import get_policy_loss
from train_loops.step_stats import STAT_KEYS, combine, fresh_log_ratio


@dataclass(frozen=True)
class WorkerOptions:
    """How a train worker process is started, beside the run's Config.

    resume_from     a checkpoint directory to start from (a Ray Train restart's own checkpoint wins)
    registry_name   the AdapterRegistry actor to publish to
    metrics_name    the RunMetrics actor that gets rank 0's per-step rows
    ds_overrides    merged into the DeepSpeed config
    """

    resume_from: str | None = None
    registry_name: str | None = REGISTRY_NAME
    metrics_name: str | None = METRICS_NAME
    ds_overrides: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> WorkerOptions:
        """Unknown keys are an error naming them."""
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            raise TypeError(f"{cls.__name__}: unknown options {unknown}")
        return cls(**values)


def loop_config(config: Config | dict, options: WorkerOptions) -> dict:
    """What a worker is started with: Ray Train's train_loop_config (and the harness's torchrun file)."""
    return {"config": config.to_dict() if isinstance(config, Config) else dict(config),
            "options": options.to_dict()}


def read_loop_config(loop: dict) -> tuple[Config, WorkerOptions]:
    """The (validated) Config and the WorkerOptions of a `loop_config` dict."""
    cfg = from_dict(loop["config"])
    validate(cfg)
    return cfg, WorkerOptions.from_dict(loop.get("options") or {})


def train_loop_per_worker(loop: dict) -> None:
    """The function Ray Train runs on every rank (`loop`: its train_loop_config, a `loop_config`)."""
    run_worker(*read_loop_config(loop))


def run_worker(cfg: Config, options: WorkerOptions) -> None:
    from train_loops.deepspeed_setup import prepare_env

    prepare_env(cfg.train.use_gpu)  # before anything imports deepspeed
    GRPOWorker(cfg, options).train()


class GRPOWorker:
    def __init__(self, cfg: Config, options: WorkerOptions):
        from common.ray_utils import named_actor
        from common.run_ingress import run_namespace_of
        from train_loops.adapter_sync import AdapterPublisher
        from train_loops.deepspeed_setup import build_engine, init_distributed
        from train_loops.lora import build_lora_model, peft_config_dict
        from train_loops.policy import PolicyLogprobs

        self.cfg, self.options = cfg, options
        self.namespace = run_namespace_of(cfg)
        self._count_start()  # first: a start that crashes below (model load, restore) must count too
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
        policy = PolicyLogprobs(self.model, chunk, cfg.grpo.temperature, cfg.grpo.top_p, cfg.model.fp32_head)
        self.engine = build_engine(policy, cfg, self.world, options.ds_overrides)
        self.metrics = named_actor(options.metrics_name, self.namespace) if self.rank == 0 else None
        self.buffer = self._find_buffer()
        # Overlapped publish: the buffer learns when a version is served (its pacing).
        on_served = self.buffer.mark_ready.remote if self.buffer is not None else None
        self.publisher = AdapterPublisher(
            rank=self.rank, zero_stage=cfg.train.zero_stage, mode=cfg.sync.mode, every=cfg.sync.every,
            delta_threshold=cfg.sync.delta_threshold, peft_config=self.peft_config,
            registry_name=options.registry_name, device=self.device, base_model_dir=cfg.model.path,
            overlap=cfg.sync.overlap_publish and cfg.run.mode == "async", on_served=on_served,
            namespace=self.namespace)
        self.token_budget = self._token_budget()
        self.info = {"liger_kernels": getattr(self.model, "liger_kernels", "off"), "fused_lora": cfg.train.fused_lora,
                     "max_tokens_per_micro_batch": self.token_budget, "device": str(self.device)}
        if self.rank == 0:
            print("trainer: " + ", ".join(f"{k} {v}" for k, v in self.info.items()), flush=True)
        self.state = {"step": 0, "version": 0, "consumed_groups": 0}
        self._restore()
        self.consumed = ConsumedPrompts.from_state(self.state.get("data"))
        self._rewind_buffer()
        self.publisher.resume_version(self.state["version"])
        # rollout.behaviour_logprobs trainer: the LoRA values of the versions whose samples the trainer still
        # takes. A restore whose version the registry does not serve from these weights (a newer publish of
        # the lost incarnation) keeps none: samples of older versions are dropped and counted.
        self.versions = VersionWeights(self.model, cfg.sync.max_staleness,
                                       enabled=cfg.rollout.behaviour_logprobs == "trainer")
        if self.publisher.version == self.state["version"]:
            self.versions.start(self.publisher.version)

    # ------------------------------------------------------------------ the loop

    def train(self) -> None:
        total = self.cfg.train.total_steps
        every = self.cfg.checkpoint.every
        row = {}
        for step in range(self.state["step"] + 1, total + 1):
            try:
                row = self._profiled_step(step) if step == self.cfg.train.profile_step else self.step(step)
            except RunClosed:  # the driver already failed or stopped the run: end without a checkpoint
                if self.rank == 0:
                    print(f"trainer: rollout buffer closed before step {step}: the driver ended the run", flush=True)
                return
            saved = (every and step % every == 0) or step == total
            if saved:
                self.save_checkpoint(step, row)
            if step < total:
                reason = self._end_reason()
                if reason is None:
                    continue
                if not saved:
                    self.save_checkpoint(step, row)
                if reason == "time" and self.rank == 0:
                    print(f"trainer: train.max_minutes ({self.cfg.train.max_minutes:g}) spent after step {step} of "
                          f"{total}: the run ends here", flush=True)
                break
        self.publisher.flush()  # the last version is served before the run reports done

    def step(self, step: int) -> dict:
        """batch -> logprobs -> (ref logprobs) -> loss -> backward -> step -> publish -> report."""
        t0 = time.perf_counter()
        batch = self.next_batch(step)
        t1 = time.perf_counter()
        stats = self.learn(batch.samples)
        t2 = time.perf_counter()
        pub = self.publisher.maybe_publish(self.model, step)
        self.versions.after_step(pub)
        pending = pub.pop("served_pending", 0)
        prompts = self._record_prompts(batch)
        self.state.update(step=step, version=self.publisher.version,
                          consumed_groups=self.state["consumed_groups"] + len(batch.groups),
                          train_seconds=self.state.get("train_seconds", 0.0) + time.perf_counter() - t0)
        if self.buffer is not None:
            # Every step: drops stale groups early and, once the version is served (at once unless its
            # publish runs in the background: then the publisher's on_served), frees generation slots.
            self.buffer.set_trainer_version.remote(pub["version"], ready=not pending)
        reward_mean, reward_std = batch.reward_stats()
        row = {**stats, **pub, "step_seconds": time.perf_counter() - t0, "batch_wait_seconds": t1 - t0,
               "learn_seconds": t2 - t1, "train_tokens_per_s": stats["seq_tokens"] / max(t2 - t1, 1e-9),
               "staleness_mean": batch.staleness_mean, "staleness_max": batch.staleness_max,
               "dropped_samples": batch.dropped_samples, "reward_mean": reward_mean, "reward_std": reward_std,
               **batch.episode_stats(), **batch.partial_stats(), **prompts}
        if self.device.type == "cuda":
            row["peak_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.report(step, row)
        return row

    def _profiled_step(self, step: int) -> dict:
        """One step under torch.profiler; rank 0 writes the top ops by self time (the speed work's
        "where the time goes") to RUN_DIR/profile.txt."""
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            row = self.step(step)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        if self.rank == 0:
            key = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
            table = prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60)
            run_dir = Path(self.cfg.run_dir)
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "profile.txt").write_text(f"step {step}, sorted by {key}\n{table}\n")
        return row

    def next_batch(self, step: int) -> StepBatch:
        batch = None
        if self.rank == 0:
            if self.buffer is None:
                raise RuntimeError(f"no {BUFFER_NAME} actor to take batches from (Ray is not up, or the driver "
                                   "did not start one)")
            batch = buffer_batch(self.buffer, self.publisher.version, self.cfg.grpo.prompts_per_step)
        obj = [batch]
        dist.broadcast_object_list(obj, src=0, device=self._obj_device())
        if obj[0] is None:  # every rank learns it together, so none waits in a collective
            raise RunClosed
        return obj[0]

    def learn(self, batch_samples: list) -> dict:
        """One optimizer step over the step's samples: this rank's share, cut into micro-batches by the
        token budget (train_loops.micro_batches), every rank running the same number of backwards. Samples
        without behaviour logprobs (rollout.behaviour_logprobs trainer) get them first: the pre-pass under
        an older version's kept weights, or this forward's own for the live version (train_loops/behaviour.py)."""
        from train_loops import micro_batches as mb

        batch_samples, unscored = scoreable(batch_samples, self.versions)
        if not batch_samples:
            raise RuntimeError(f"no sample of this step can be scored: {unscored} samples of versions whose "
                               "weights the trainer no longer keeps (rollout.behaviour_logprobs trainer)")
        ranks = mb.assign_ranks(batch_samples, self.world)
        n_micro = mb.micro_batches_needed(ranks, self.token_budget)
        micro = mb.plan(ranks, self.rank, self.token_budget, n_micro)
        token_denom, seq_denom = mb.step_denominators(ranks)
        current = self.publisher.version  # the version the weights being trained hold now
        filled, behaviour_stats = {}, {}
        if self.versions.enabled or any(s.behaviour_logprobs is None for s in ranks[self.rank]):
            filled, behaviour_stats = prepass(
                ranks[self.rank], self.versions, self.engine, lambda p: collate(p, self.pad_id, self.device),
                lambda p: mb.pack(p, self.token_budget), self.engine.module)
            behaviour_stats["behaviour_unscored_samples"] = unscored
        lr = float(self.engine.get_lr()[0])  # this step's (the schedule moves on at the boundary)
        micro_stats = []
        for i in range(n_micro):
            # A rank with fewer sequences than the others' micro-batch count repeats one with weight 0:
            # its backward must still run, or the ZeRO reductions of the ranks go out of step.
            part, weight = (micro[i], 1.0) if i < len(micro) else (micro[-1][:1], 0.0)
            engine_rows = [s.behaviour_logprobs is not None for s in part]
            part = [filled.get(id(s), s) for s in part]
            tensors = collate(part, self.pad_id, self.device)
            fwd = {k: tensors[k] for k in ("input_ids", "attention_mask", "pred_pos", "targets", "mask")}
            logp, entropy = self.engine(**fwd)
            tensors["behaviour_logp"] = fill_from_forward(tensors["behaviour_logp"], logp)
            ref = None
            if self.cfg.grpo.kl_coef > 0:
                with torch.no_grad():
                    ref, _ = self.engine(**fwd, disable_adapter=True)
            loss, part_stats = self._loss(logp, tensors, ref, entropy, token_denom, seq_denom)
            self.engine.set_gradient_accumulation_boundary(i == n_micro - 1)
            self.engine.backward(loss * weight, scale_wrt_gas=False)
            self.engine.step()  # applies the update only at the boundary
            if weight:
                part_stats.update(fresh_log_ratio(logp, tensors, part, current, engine_rows))
                micro_stats.append({**part_stats, "loss": float(loss.detach()),
                                    "seq_tokens": int(tensors["attention_mask"].sum()),
                                    "padded_tokens": int(tensors["attention_mask"].numel())})
        stats = combine(micro_stats)
        stats["loss"] *= len(micro_stats)  # micro-batch losses are shares of the step's loss: sum them
        stats["micro_batches"] = n_micro
        stats.update(behaviour_stats)
        stats["lr"] = lr
        grad_norm = self.engine.get_global_grad_norm()
        stats["grad_norm"] = float(grad_norm) if grad_norm is not None else 0.0
        return stats

    def _loss(self, logp, tensors: dict, ref, entropy, token_denom: float, seq_denom: float):
        return self.policy_loss(logp, tensors["behaviour_logp"], tensors["mask"], tensors["advantages"],
                                opts=self.cfg.grpo, ref_logp=ref, entropy=entropy,
                                token_denominator=token_denom, seq_denominator=seq_denom)

    def _token_budget(self) -> int:
        """train.max_tokens_per_micro_batch, or the automatic one agreed by all ranks (the smallest)."""
        from train_loops.fused_kernels import liger_applied
        from train_loops.micro_batches import auto_budget

        t = self.cfg.train
        if t.max_tokens_per_micro_batch is not None:
            return t.max_tokens_per_micro_batch
        dtype_bytes = 4 if self.cfg.trainer_dtype == "float32" else 2
        liger = liger_applied(getattr(self.model, "liger_kernels", "off"))
        mine = auto_budget(self.model.config, self.device, dtype_bytes, t.gradient_checkpointing,
                           self.cfg.model.max_model_len, t.logprob_chunk, liger=liger)
        v = torch.tensor([mine], dtype=torch.int64, device=self.device)
        dist.all_reduce(v, op=dist.ReduceOp.MIN)
        return int(v.item())

    # ------------------------------------------------------------------ reporting, checkpoints

    def report(self, step: int, row: dict) -> dict | None:
        """Average the per-rank stats; rank 0 sends the row to the RunMetrics actor and returns it (None
        on the other ranks)."""
        rows = [None] * self.world
        dist.all_gather_object(rows, row)
        if self.rank != 0:
            return None
        merged = {**row, **combine([{k: r[k] for k in r if k in STAT_KEYS} for r in rows])}
        merged["train_tokens_per_s"] = merged["seq_tokens"] / max(max(r["learn_seconds"] for r in rows), 1e-9)
        if self.metrics is not None:
            self.metrics.log_train.remote(step, merged)
        return merged

    def save_checkpoint(self, step: int, row: dict) -> None:
        # A checkpoint's version is one the registry holds: a resume republishes from a consistent state.
        self.publisher.flush()
        from train_loops.adapter_sync import gather_lora_state

        lora = gather_lora_state(self.model, self.cfg.train.zero_stage)
        name = f"checkpoint_{step:06d}"
        import ray.train

        local = tempfile.mkdtemp(prefix="grpo-ckpt-")
        try:
            ckpt.save(self.engine, local, rank=self.rank, state=self.state, lora=lora, peft_config=self.peft_config)
            metrics = {k: v for k, v in row.items() if isinstance(v, (int, float))}
            ray.train.report({**metrics, "step": step, "version": self.state["version"]},
                             checkpoint=ray.train.Checkpoint.from_directory(local), checkpoint_dir_name=name)
        finally:
            shutil.rmtree(local, ignore_errors=True)

    def _restore(self) -> None:
        """A Ray Train restart's own checkpoint first (failure recovery), else `resume_from` (the
        options', then the config's)."""
        import ray.train

        own = ray.train.get_checkpoint()
        if own is not None:
            with own.as_directory() as path:
                self.state = ckpt.load(self.engine, path, rank=self.rank)
            return
        path = self.options.resume_from or self.cfg.checkpoint.resume_from
        if path:
            self.state = ckpt.load(self.engine, path, rank=self.rank)

    def _record_prompts(self, batch: StepBatch) -> dict:
        """The data cursor's trainer half: this step's prompts (and the groups filtered since the last
        step) join the record the next checkpoint saves. Returns the row's `prompts`/`prompt_repeats`."""
        keys = [prompt_key(g.epoch, g.prompt_id) for g in batch.groups]
        for k in [*keys, *batch.filtered]:
            self.consumed.add(*parse_prompt_key(k))
        self.state["data"] = self.consumed.to_state()
        return {"prompts": keys, **({"prompts_filtered": list(batch.filtered)} if batch.filtered else {}),
                "prompt_repeats": self.consumed.repeats}

    def _find_buffer(self):
        """Rank 0's handle on the RolloutBuffer actor; None on the other ranks, and where there is none."""
        if self.rank != 0:
            return None
        return self._find_buffer_actor(self.namespace)

    @staticmethod
    def _find_buffer_actor(namespace: str):
        from common.ray_utils import named_actor

        try:
            return named_actor(BUFFER_NAME, namespace)
        except ValueError:  # Ray is up but no buffer was started
            return None

    def _count_start(self) -> None:
        """Rank 0 tells the buffer a worker group started: the driver's restart budget (app/watch.py) counts
        starts with no step between. Ray Train's rank, since torch.distributed is not up yet."""
        import ray
        import ray.train

        if ray.train.get_context().get_world_rank() != 0:
            return
        buffer = self._find_buffer_actor(self.namespace)
        if buffer is not None:
            ray.get(buffer.count_start.remote())

    def _rewind_buffer(self) -> None:
        """After a restore: prompts the buffer handed to steps this checkpoint does not hold (they died
        with the failed workers) are handed out again. A no-op on a fresh start or a driver resume."""
        if self.buffer is not None:
            import ray

            ray.get(self.buffer.rewind.remote(self.consumed.to_state()))

    def _end_reason(self) -> str | None:
        """Collective: whether the run ends after this step, decided by rank 0 (each rank's clock differs) and
        broadcast: "stop" when the driver asked to stop (its buffer says so), "time" when train.max_minutes of
        steps are spent (the steps' own seconds, kept in the checkpoint's state: restarts and --resume go on
        counting), None to go on."""
        reason = None
        if self.rank == 0:
            limit = self.cfg.train.max_minutes
            if limit is not None and self.state.get("train_seconds", 0.0) >= 60.0 * limit:
                reason = "time"
            elif self.buffer is not None:
                import ray

                try:
                    reason = "stop" if ray.get(self.buffer.stop_requested.remote(), timeout=30) else None
                except Exception:  # a buffer that cannot answer asked for nothing
                    reason = None
        obj = [reason]
        if dist.is_initialized() and self.world > 1:
            dist.broadcast_object_list(obj, src=0, device=self._obj_device())
        return obj[0]

    def _device(self) -> torch.device:
        if not self.cfg.train.use_gpu:
            return torch.device("cpu")
        local = self._local_rank()
        torch.cuda.set_device(local)
        return torch.device("cuda", local)

    def _local_rank(self) -> int:
        import ray.train

        return ray.train.get_context().get_local_rank()

    def _obj_device(self):
        return self.device if self.device.type == "cuda" else None
