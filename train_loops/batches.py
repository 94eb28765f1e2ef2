"""Where a step's samples come from (the RolloutBuffer, or a deterministic synthetic stream) and how a
list of samples becomes padded tensors for the loss."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from common.names import BUFFER_NAME, NAMESPACE
from common.types import Group, Sample
from train_loops.grpo import group_advantages


@dataclass
class StepBatch:
    """All groups of one optimizer step plus what the buffer said about them."""

    groups: list[Group]
    staleness_mean: float = 0.0
    staleness_max: int = 0
    dropped_samples: int = 0
    wait_seconds: float = 0.0
    filtered: list[str] = field(default_factory=list)  # "epoch:id" of groups dynamic sampling dropped since

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g.samples]

    def reward_stats(self) -> tuple[float, float]:
        r = torch.tensor([s.reward for s in self.samples], dtype=torch.float64)
        return float(r.mean()), float(r.std()) if r.numel() > 1 else 0.0


def synthetic_batch(seed: int, step: int, n_groups: int, group_size: int, vocab: int,
                    max_new_tokens: int, scale_rewards: bool = True, prompt_len: int | None = None,
                    completion_len: int | None = None) -> StepBatch:
    """A pure function of (seed, step): random prompts/completions, 0/1 rewards, and behaviour logprobs
    near the uniform -log(vocab) (what a freshly initialised tiny model gives), so ratios stay near 1.
    Lengths are random (prompts 4-12, completions 2..max_new_tokens) unless `prompt_len` /
    `completion_len` fix them (speed benchmarks)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    rewards = (torch.rand(n_groups, group_size, generator=g) < 0.5).float()
    adv = group_advantages(rewards, scale_by_std=scale_rewards)
    groups = []
    for p in range(n_groups):
        plen = prompt_len or int(torch.randint(4, 13, (1,), generator=g))
        prompt = torch.randint(3, vocab, (plen,), generator=g).tolist()
        samples = []
        for k in range(group_size):
            clen = completion_len or int(torch.randint(2, max_new_tokens + 1, (1,), generator=g))
            comp = torch.randint(3, vocab, (clen,), generator=g).tolist()
            blp = (-math.log(vocab) + 0.05 * torch.randn(clen, generator=g)).tolist()
            samples.append(Sample(prompt_ids=prompt, completion_ids=comp, behaviour_logprobs=blp,
                                  reward=float(rewards[p, k]), advantage=float(adv[p, k]), version=step,
                                  prompt_id=f"s{step}-p{p}", group_id=f"s{step}-p{p}"))
        groups.append(Group(samples=samples, version=step, prompt_id=f"s{step}-p{p}"))
    return StepBatch(groups=groups)


def buffer_batch(trainer_version: int, n_groups: int) -> StepBatch:
    """Rank 0 only: block on the named RolloutBuffer actor for one step's groups."""
    import ray

    buf = ray.get_actor(BUFFER_NAME, namespace=NAMESPACE)
    out = ray.get(buf.get_batch.remote(trainer_version, n_groups))
    return StepBatch(groups=out["groups"], staleness_mean=float(out["staleness_mean"]),
                     staleness_max=int(out["staleness_max"]), dropped_samples=int(out["dropped_samples"]),
                     wait_seconds=float(out["wait_seconds"]), filtered=list(out.get("filtered") or []))


def collate(samples: list[Sample], pad_id: int = 0, device: str | torch.device = "cpu") -> dict:
    """Right-padded prompt+completion ids, and per completion token: the position whose hidden state
    predicts it (`pred_pos`), the token (`targets`), behaviour logprob and mask."""
    B = len(samples)
    L = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    T = max(len(s.completion_ids) for s in samples)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros(B, L, dtype=torch.long)
    pred_pos = torch.zeros(B, T, dtype=torch.long)
    targets = torch.zeros(B, T, dtype=torch.long)
    behaviour = torch.zeros(B, T, dtype=torch.float32)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        if len(s.behaviour_logprobs) != c:
            raise ValueError(f"sample {s.prompt_id}/{s.group_id}: {c} completion tokens but "
                             f"{len(s.behaviour_logprobs)} behaviour logprobs")
        input_ids[b, :p + c] = torch.tensor(s.prompt_ids + s.completion_ids)
        attn[b, :p + c] = 1
        pred_pos[b, :c] = torch.arange(p - 1, p + c - 1)
        targets[b, :c] = torch.tensor(s.completion_ids)
        behaviour[b, :c] = torch.tensor(s.behaviour_logprobs, dtype=torch.float32)
        mask[b, :c] = True
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    out = {"input_ids": input_ids, "attention_mask": attn, "pred_pos": pred_pos, "targets": targets,
           "behaviour_logp": behaviour, "mask": mask, "advantages": adv}
    return {k: v.to(device) for k, v in out.items()}
