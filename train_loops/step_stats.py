"""A training step's numbers: how the stats of micro-batches, then of ranks, combine into the step's row,
and the fresh-sample logprob gap."""
from __future__ import annotations

import torch

MAX_KEYS = ("log_ratio_abs_max",)
SUM_KEYS = ("tokens", "seq_tokens", "padded_tokens", "behaviour_trainer_samples", "behaviour_prepass_samples")
# Per-rank stats averaged (or summed, or maxed) across ranks; the rest of a row is rank 0's.
STAT_KEYS = ("loss", "kl", "clip_frac", "entropy", "log_ratio_abs_mean", "log_ratio_abs_max", "tokens",
             "seq_tokens", "padded_tokens", "grad_norm", "tis_weight_mean", "tis_clip_frac", "micro_batches",
             "is_weight_mean", "seq_log_ratio_abs_mean", "log_ratio_fresh", "behaviour_trainer_samples",
             "behaviour_prepass_samples", "behaviour_prepass_seconds")


def fresh_log_ratio(logp, tensors: dict, part: list, current: int, engine_rows: list[bool] | None = None) -> dict:
    """Mean |trainer - vLLM| logprob over the tokens of samples the current weights generated: the
    engines' numerical mismatch alone, without the policy drift that staler samples add. `engine_rows`:
    which rows' behaviour logprobs came from the engine (the others', the trainer's own, would read 0)."""
    rows = engine_rows if engine_rows is not None else [True] * len(part)
    fresh = torch.tensor([s.version == current and e for s, e in zip(part, rows)], device=logp.device)
    sel = tensors["mask"] & fresh[:, None]
    if not bool(sel.any()):
        return {}
    return {"log_ratio_fresh": float((logp.detach().float() - tensors["behaviour_logp"]).abs()[sel].mean())}


def combine(stats: list[dict]) -> dict:
    """Mean over micro-batches / ranks (of those that have the key), max for maxima, sum for counts."""
    out = {}
    for k in dict.fromkeys(k for s in stats for k in s):
        vals = [s[k] for s in stats if k in s]
        out[k] = max(vals) if k in MAX_KEYS else sum(vals) if k in SUM_KEYS else sum(vals) / len(vals)
    return out
