"""Where a step's samples come from (the RolloutBuffer; train_loops/harness.py makes synthetic ones) and how
a list of samples becomes padded tensors for the loss."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.types import Group, Sample


@dataclass
class StepBatch:
    """All groups of one optimizer step plus what the buffer said about them."""

    groups: list[Group]
    staleness_mean: float = 0.0
    staleness_max: int = 0
    staleness_accept_max: int = 0
    dropped_samples: int = 0
    wait_seconds: float = 0.0
    served_wait_seconds: float = 0.0  # rollout.partial: of wait_seconds, waiting for the last version to be served
    filtered: list[str] = field(default_factory=list)  # "epoch:id" of groups dynamic sampling dropped since

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g.samples]

    def reward_stats(self) -> tuple[float, float]:
        r = torch.tensor([s.reward for s in self.samples], dtype=torch.float64)
        return float(r.mean()), float(r.std()) if r.numel() > 1 else 0.0

    def partial_stats(self) -> dict:
        """rollout.partial metrics of the step's samples (none when no sample ran partial): continuations
        (`partial_resumed`), distinct versions per sample (`versions_per_sample_mean`) and the prompt + kept tokens
        the continuations prefilled again (`tokens_regenerated`)."""
        samples = [s for s in self.samples if s.token_versions is not None]
        if not samples:
            return {}
        return {"partial_resumed": sum(s.resumed for s in samples),
                "versions_per_sample_mean": sum(s.n_versions for s in samples) / len(samples),
                "tokens_regenerated": sum(s.regenerated_tokens for s in samples),
                "staleness_accept_max": self.staleness_accept_max, "served_wait_seconds": self.served_wait_seconds}

    def episode_stats(self) -> dict:
        """Multi-turn metrics of the step's episodes (none for single-turn samples): turns and tool calls
        per episode, truncated episodes and tool errors in the step, the share of the trained sequences'
        completion tokens the environment added, and per turn k the share of its prompt the engine found
        in its prefix cache (`prefix_hit_turn{k}`)."""
        eps = [s.episode for s in self.samples if s.episode is not None]
        if not eps:
            return {}
        n = len(eps)
        env, sampled = sum(e["env_tokens"] for e in eps), sum(e["sampled_tokens"] for e in eps)
        out = {"episode_turns_mean": sum(e["turns"] for e in eps) / n,
               "episode_truncated": sum(bool(e["truncated"]) for e in eps),
               "tool_calls_mean": sum(e["tool_calls"] for e in eps) / n,
               "tool_errors": sum(e["tool_errors"] for e in eps),
               "env_tokens_fraction": env / max(1, env + sampled)}
        for k in range(max(len(e["prefix_hits"]) for e in eps)):
            hits = [e["prefix_hits"][k] for e in eps if len(e["prefix_hits"]) > k]
            out[f"prefix_hit_turn{k + 1}"] = sum(hits) / len(hits)
        # a verifiers environment's reward functions, each one's mean score (app/verifiers_env.py)
        for name in sorted({name for e in eps for name in e.get("rewards") or {}}):
            scores = [e["rewards"][name] for e in eps if name in (e.get("rewards") or {})]
            out[f"reward/{name}"] = sum(scores) / len(scores)
        if any("retokenized_turns" in e for e in eps):
            out["retokenized_turns"] = sum(e.get("retokenized_turns", 0) for e in eps)
        return out


class RunClosed(Exception):
    """The driver closed the rollout buffer before the trainer's last step: the run ended elsewhere."""


def buffer_batch(buffer, trainer_version: int, n_groups: int) -> StepBatch | None:
    """Rank 0 only: block on the RolloutBuffer actor (`buffer`, its handle) for one step's groups; None
    once the driver closed the buffer."""
    import ray

    out = ray.get(buffer.get_batch.remote(trainer_version, n_groups))
    if out is None:
        return None
    return StepBatch(groups=out["groups"], staleness_mean=float(out["staleness_mean"]),
                     staleness_max=int(out["staleness_max"]), dropped_samples=int(out["dropped_samples"]),
                     staleness_accept_max=int(out.get("staleness_accept_max", out["staleness_max"])),
                     wait_seconds=float(out["wait_seconds"]),
                     served_wait_seconds=float(out.get("served_wait_seconds", 0.0)),
                     filtered=list(out.get("filtered") or []))


def collate(samples: list[Sample], pad_id: int = 0, device: str | torch.device = "cpu") -> dict:
    """Right-padded prompt+completion ids, and per completion token: the position whose hidden state
    predicts it (`pred_pos`), the token (`targets`), behaviour logprob and mask (sampled tokens only).
    A sample without behaviour logprobs (None: the trainer computes them, train_loops/behaviour.py) gets NaN
    there, which the training forward fills (`behaviour.fill_from_forward`)."""
    rows = len(samples)
    width = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    completion_width = max(len(s.completion_ids) for s in samples)
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    attn = torch.zeros(rows, width, dtype=torch.long)
    pred_pos = torch.zeros(rows, completion_width, dtype=torch.long)
    targets = torch.zeros(rows, completion_width, dtype=torch.long)
    behaviour = torch.zeros(rows, completion_width, dtype=torch.float32)
    mask = torch.zeros(rows, completion_width, dtype=torch.bool)
    for row, sample in enumerate(samples):
        n_prompt, n_completion = len(sample.prompt_ids), len(sample.completion_ids)
        if sample.behaviour_logprobs is not None and len(sample.behaviour_logprobs) != n_completion:
            raise ValueError(f"sample {sample.prompt_id}/{sample.group_id}: {n_completion} completion tokens but "
                             f"{len(sample.behaviour_logprobs)} behaviour logprobs")
        if sample.completion_mask is not None and len(sample.completion_mask) != n_completion:
            raise ValueError(f"sample {sample.prompt_id}/{sample.group_id}: {n_completion} completion tokens but "
                             f"a mask of {len(sample.completion_mask)}")
        end = n_prompt + n_completion
        input_ids[row, :end] = torch.tensor(sample.prompt_ids + sample.completion_ids)
        attn[row, :end] = 1
        pred_pos[row, :n_completion] = torch.arange(n_prompt - 1, end - 1)
        targets[row, :n_completion] = torch.tensor(sample.completion_ids)
        behaviour[row, :n_completion] = (torch.tensor(sample.behaviour_logprobs, dtype=torch.float32)
                                         if sample.behaviour_logprobs is not None else torch.nan)
        if sample.completion_mask is None:
            mask[row, :n_completion] = True
        else:  # multi-turn: the environment's tokens are context, never trained on
            mask[row, :n_completion] = torch.tensor(sample.completion_mask, dtype=torch.bool)
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    out = {"input_ids": input_ids, "attention_mask": attn, "pred_pos": pred_pos, "targets": targets,
           "behaviour_logp": behaviour, "mask": mask, "advantages": adv}
    return {k: v.to(device) for k, v in out.items()}
