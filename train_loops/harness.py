"""The trainer on its own, for tests and the speed benchmarks: `GRPOWorker` fed synthetic batches (a pure
function of seed and step: no rollouts, no RolloutBuffer), run under plain torchrun (no Ray at all) or under
Ray Train, with rank 0 recording what it did to a directory (no RunMetrics needed to read it back).

    python -m torch.distributed.run --nproc_per_node N -m train_loops.harness LOOP.json

LOOP.json holds `loop_config(cfg, HarnessOptions(...))`. Under Ray Train: `build_trainer(cfg, run_dir,
HarnessOptions(...))` here. The production loop (train_loops.worker) knows nothing of this module.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from common.config import Config, from_dict, validate
from common.types import Group, Sample
from train_loops import checkpoint as ckpt
from train_loops.batches import StepBatch
from train_loops.grpo import group_advantages
from train_loops.worker import GRPOWorker, WorkerOptions


@dataclass(frozen=True)
class HarnessOptions(WorkerOptions):
    """WorkerOptions plus how the harness runs the worker.

    runner          "torchrun" (`main`: no Ray; checkpoints go to `checkpoint_dir`) | "ray" (`build_trainer`)
    batch_source    "synthetic": `synthetic_batch` of (seed, step), with fixed lengths when
                    `synthetic_prompt_len` / `synthetic_completion_len` are set (speed benchmarks);
                    "buffer": the RolloutBuffer actor, as in production
    checkpoint_dir  torchrun: where checkpoint_<step> directories go (default RUN_DIR/checkpoints)
    record_dir      rank 0 writes trainer_info.json, steps.jsonl (one row per step) and, at the end, the
                    full weights (full_state.safetensors, PEFT names)
    """

    runner: Literal["ray", "torchrun"] = "torchrun"
    batch_source: Literal["buffer", "synthetic"] = "synthetic"
    synthetic_prompt_len: int | None = None
    synthetic_completion_len: int | None = None
    checkpoint_dir: str | None = None
    record_dir: str | None = None

    def __post_init__(self) -> None:
        if self.runner not in ("ray", "torchrun"):
            raise ValueError(f"runner {self.runner!r} is not ray or torchrun")
        if self.batch_source not in ("buffer", "synthetic"):
            raise ValueError(f"batch_source {self.batch_source!r} is not buffer or synthetic")


def read_loop_config(loop: dict) -> tuple[Config, HarnessOptions]:
    """The (validated) Config and the HarnessOptions of a `loop_config` dict."""
    cfg = from_dict(loop["config"])
    validate(cfg)
    return cfg, HarnessOptions.from_dict(loop.get("options") or {})


def run_worker(cfg: Config, options: HarnessOptions) -> None:
    from train_loops.deepspeed_setup import prepare_env

    prepare_env(cfg.train.use_gpu)  # before anything imports deepspeed
    HarnessWorker(cfg, options).train()


def train_loop_per_worker(loop: dict) -> None:
    """Ray Train's loop function for a harness run."""
    run_worker(*read_loop_config(loop))


def build_trainer(cfg: Config, run_dir: str | Path, options: HarnessOptions | None = None, **kwargs):
    """train_loops.trainer.build_trainer running HarnessWorker (runner "ray"); `kwargs` go on to it."""
    from train_loops import trainer

    options = replace(options or HarnessOptions(), runner="ray")
    return trainer.build_trainer(cfg, run_dir, options=options, loop=train_loop_per_worker, **kwargs)


class HarnessWorker(GRPOWorker):
    """GRPOWorker with the harness's batch source, runner and record directory."""

    options: HarnessOptions

    def __init__(self, cfg: Config, options: HarnessOptions):
        super().__init__(cfg, options)
        record = self._record_dir()
        if record is not None:
            (record / "trainer_info.json").write_text(json.dumps(self.info))

    @property
    def synthetic(self) -> bool:
        return self.options.batch_source == "synthetic"

    @property
    def torchrun(self) -> bool:
        return self.options.runner == "torchrun"

    def train(self) -> None:
        super().train()
        self._record_final_weights()

    def next_batch(self, step: int) -> StepBatch:
        if not self.synthetic:
            return super().next_batch(step)
        grpo, o = self.cfg.grpo, self.options
        return synthetic_batch(self.cfg.train.seed, step, grpo.prompts_per_step, grpo.group_size, self.vocab,
                               grpo.max_new_tokens, self.cfg.scale_advantages,
                               prompt_len=o.synthetic_prompt_len, completion_len=o.synthetic_completion_len)

    def report(self, step: int, row: dict) -> dict | None:
        merged = super().report(step, row)
        record = self._record_dir()
        if merged is not None and record is not None:
            with (record / "steps.jsonl").open("a") as out:
                out.write(json.dumps({"step": step, **merged}) + "\n")
        return merged

    def save_checkpoint(self, step: int, row: dict) -> None:
        if not self.torchrun:
            return super().save_checkpoint(step, row)
        self.publisher.flush()
        from train_loops.adapter_sync import gather_lora_state

        lora = gather_lora_state(self.model, self.cfg.train.zero_stage)
        parent = Path(self.options.checkpoint_dir or self.cfg.run_dir / "checkpoints")
        ckpt.save(self.engine, parent / f"checkpoint_{step:06d}", rank=self.rank, state=self.state, lora=lora,
                  peft_config=self.peft_config)
        if self.rank == 0:
            ckpt.trim(parent, self.cfg.checkpoint.keep)

    def _restore(self) -> None:
        if not self.torchrun:
            return super()._restore()
        path = self.options.resume_from or self.cfg.checkpoint.resume_from
        if path:
            self.state = ckpt.load(self.engine, path, rank=self.rank)

    def _record_prompts(self, batch: StepBatch) -> dict:
        return {} if self.synthetic else super()._record_prompts(batch)

    def _find_buffer(self):
        return None if self.synthetic else super()._find_buffer()

    def _count_start(self) -> None:
        if not (self.torchrun or self.synthetic):
            super()._count_start()

    def _local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0")) if self.torchrun else super()._local_rank()

    def _record_dir(self) -> Path | None:
        """Rank 0's `record_dir` (created), or None."""
        if self.rank != 0 or not self.options.record_dir:
            return None
        path = Path(self.options.record_dir)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _record_final_weights(self) -> None:
        """With `record_dir`: the trainer's full final weights (base + LoRA, PEFT names) from rank 0.
        Collective under ZeRO-3 (every rank joins the gather)."""
        if not self.options.record_dir:
            return
        params = list(self.model.parameters())
        ctx = contextlib.nullcontext()
        if self.cfg.train.zero_stage == 3:
            import deepspeed

            ctx = deepspeed.zero.GatheredParameters(params, modifier_rank=None)
        with ctx:
            full = {n: p.detach().to("cpu", copy=True).contiguous() for n, p in self.model.named_parameters()}
        if self.rank == 0:
            from safetensors.torch import save_file

            save_file(full, str(self._record_dir() / "full_state.safetensors"))
        dist.barrier()


def synthetic_batch(seed: int, step: int, n_groups: int, group_size: int, vocab: int,
                    max_new_tokens: int, scale_rewards: bool = True, prompt_len: int | None = None,
                    completion_len: int | None = None) -> StepBatch:
    """A pure function of (seed, step): random prompts/completions, 0/1 rewards, and behaviour logprobs
    near the uniform -log(vocab) (what a freshly initialised tiny model gives), so ratios stay near 1.
    Lengths are random (prompts 4-12, completions 2..max_new_tokens) unless `prompt_len` /
    `completion_len` fix them (speed benchmarks)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    rewards = (torch.rand(n_groups, group_size, generator=gen) < 0.5).float()
    adv = group_advantages(rewards, scale_by_std=scale_rewards)
    groups = []
    for index in range(n_groups):
        plen = prompt_len or int(torch.randint(4, 13, (1,), generator=gen))
        prompt = torch.randint(3, vocab, (plen,), generator=gen).tolist()
        prompt_id = f"s{step}-p{index}"
        samples = []
        for member in range(group_size):
            clen = completion_len or int(torch.randint(2, max_new_tokens + 1, (1,), generator=gen))
            comp = torch.randint(3, vocab, (clen,), generator=gen).tolist()
            blp = (-math.log(vocab) + 0.05 * torch.randn(clen, generator=gen)).tolist()
            samples.append(Sample(prompt_ids=prompt, completion_ids=comp, behaviour_logprobs=blp,
                                  reward=float(rewards[index, member]), advantage=float(adv[index, member]),
                                  version=step, prompt_id=prompt_id, group_id=prompt_id))
        groups.append(Group(samples=samples, version=step, prompt_id=prompt_id))
    return StepBatch(groups=groups)


def main(argv: list[str] | None = None) -> int:
    """torchrun entry: the one argument is a JSON file holding `loop_config(cfg, options)`."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m torch.distributed.run ... -m train_loops.harness LOOP.json", file=sys.stderr)
        return 2
    cfg, options = read_loop_config(json.loads(Path(argv[0]).read_text()))
    run_worker(cfg, replace(options, runner="torchrun"))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Everything is written and the group is gone: leave without the interpreter's teardown, where a joinable
    # C++ thread of the CPU collectives' stack now and then calls std::terminate ("terminate called without an
    # active exception", SIGABRT) and torchrun then fails a run that finished.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
