"""GRPO math: group-relative advantages, the clipped off-policy surrogate, and token logprobs computed
in chunks so a full-vocabulary float32 log-softmax over the whole batch never exists at once.

Shapes: B sequences, T completion positions (right-padded), `mask[b, t] = 1` on real completion tokens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def group_advantages(rewards: torch.Tensor, scale_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """rewards [P, G] -> advantages [P, G]: reward minus the group mean, divided by the group std
    (unbiased, like the GRPO paper) unless `scale_by_std=False` (Dr. GRPO)."""
    rewards = rewards.float()
    adv = rewards - rewards.mean(dim=1, keepdim=True)
    if scale_by_std:
        adv = adv / (rewards.std(dim=1, keepdim=True) + eps)
    return adv


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_agg: str,
              token_denominator: float | None = None) -> torch.Tensor:
    """Reduce a [B, T] per-token quantity over the real tokens of each sequence, then the batch.

    `token_denominator` (token-mean only) replaces this micro-batch's token count: the trainer passes the
    whole step's token count divided by (ranks x micro-batches), so after DeepSpeed averages gradients
    over ranks and accumulation steps the result is the mean over every token of the step, not a mean of
    per-rank means (which would weight tokens of short micro-batches more)."""
    mask = mask.to(per_token.dtype)
    if loss_agg == "token-mean":
        denom = mask.sum().clamp(min=1.0) if token_denominator is None else token_denominator
        return (per_token * mask).sum() / denom
    seq_sum = (per_token * mask).sum(dim=1)
    if loss_agg == "seq-mean-token-mean":
        return (seq_sum / mask.sum(dim=1).clamp(min=1.0)).mean()
    if loss_agg == "seq-mean-token-sum":
        return seq_sum.mean()
    raise ValueError(f"loss_agg {loss_agg!r} is not one of {LOSS_AGGS}")


def grpo_loss(logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor, *,
              clip_eps_low: float, clip_eps_high: float, loss_agg: str = "token-mean", kl_coef: float = 0.0,
              ref_logp: torch.Tensor | None = None, tis_cap: float | None = None,
              entropy: torch.Tensor | None = None,
              token_denominator: float | None = None) -> tuple[torch.Tensor, dict]:
    """Clipped policy-gradient loss over behaviour (vLLM) logprobs; returns (loss, float stats).

    Without TIS: r = exp(logp - behaviour_logp) and the per-token loss is -min(r*A, clip(r, 1-lo, 1+hi)*A)
    (PPO/GRPO, the behaviour policy is the proximal one).

    With `tis_cap` (truncated importance sampling, the decoupled form of Yao et al. 2025 / verl): the
    proximal policy is the trainer's own current policy sg(pi), so r = exp(logp - sg(logp)) (value 1,
    gradient d logp), and the trainer/sampler mismatch is corrected by the detached weight
    w = min(exp(sg(logp) - behaviour_logp), tis_cap); per-token loss = -w * min(r*A, clip(r)*A).
    Each batch is used for one optimizer step, so this is truncated-IS REINFORCE; the PPO ratio against
    the behaviour policy is still what `clip_frac` reports.

    KL: k3 estimator exp(ref - logp) - (ref - logp) - 1 against the base policy, added as kl_coef * KL.
    `advantages` is [B] (one per sequence) or [B, T]; `token_denominator`: see `aggregate`.
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    advantages = advantages.to(logp.dtype)
    maskf = mask.to(logp.dtype)
    log_ratio_behaviour = logp - behaviour_logp
    if tis_cap is None:
        ratio = torch.exp(log_ratio_behaviour)
        weight = None
    else:
        ratio = torch.exp(logp - logp.detach())
        weight = torch.exp(log_ratio_behaviour.detach()).clamp(max=tis_cap)
    clipped = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    if weight is not None:
        per_token = per_token * weight
    kl_tok = None
    if ref_logp is not None:
        d = ref_logp - logp
        kl_tok = torch.exp(d) - d - 1.0
        if kl_coef:
            per_token = per_token + kl_coef * kl_tok
    loss = aggregate(per_token, mask, loss_agg, token_denominator)

    with torch.no_grad():
        n = maskf.sum().clamp(min=1.0)
        real = mask.bool()
        r_b = torch.exp(log_ratio_behaviour)
        clip_hit = ((r_b > 1.0 + clip_eps_high) & (advantages > 0)) | ((r_b < 1.0 - clip_eps_low) & (advantages < 0))
        abs_lr = log_ratio_behaviour.abs()
        stats = {
            "clip_frac": float((clip_hit.to(logp.dtype) * maskf).sum() / n),
            "log_ratio_abs_mean": float((abs_lr * maskf).sum() / n),
            "log_ratio_abs_max": float(abs_lr[real].max()) if real.any() else 0.0,
            "kl": float((kl_tok * maskf).sum() / n) if kl_tok is not None else 0.0,
            "tokens": int(maskf.sum()),
        }
        if weight is not None:
            stats["tis_weight_mean"] = float((weight * maskf).sum() / n)
            stats["tis_clip_frac"] = float(((r_b > tis_cap).to(logp.dtype) * maskf).sum() / n)
        if entropy is not None:
            stats["entropy"] = float((entropy.to(logp.dtype) * maskf).sum() / n)
    return loss, stats


def _chunk_logprobs(hidden: torch.Tensor, targets: torch.Tensor, lm_head: torch.nn.Module, temperature: float):
    logits = lm_head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    logz = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - logz
    with torch.no_grad():
        probs_logp = logits - logz[:, None]
        entropy = -(probs_logp.exp() * probs_logp).sum(-1)
    return logp, entropy


def chunked_token_logprobs(hidden: torch.Tensor, targets: torch.Tensor, lm_head: torch.nn.Module,
                           chunk: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [N, H], targets [N] -> (logp [N] with grad, entropy [N] detached).

    Each chunk of `chunk` tokens runs under activation checkpointing: the backward recomputes that
    chunk's logits instead of keeping them, so peak memory is one chunk x vocab in float32."""
    logps, ents = [], []
    for i in range(0, hidden.shape[0], chunk):
        h, y = hidden[i:i + chunk], targets[i:i + chunk]
        if torch.is_grad_enabled() and h.requires_grad:
            lp, ent = checkpoint(_chunk_logprobs, h, y, lm_head, temperature, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(h, y, lm_head, temperature)
        logps.append(lp)
        ents.append(ent)
    if not logps:
        z = hidden.new_zeros(0, dtype=torch.float32)
        return z, z
    return torch.cat(logps), torch.cat(ents)


def sequence_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, pred_pos: torch.Tensor,
                      targets: torch.Tensor, mask: torch.Tensor, chunk: int,
                      temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token logprobs of the completion tokens only.

    `model` is a HF causal LM (or a PEFT wrapper of one); its decoder runs once over the full sequences,
    then only the hidden states at `pred_pos` (the position predicting each completion token) go
    through the LM head, chunked. Returns (logp [B, T], entropy [B, T]), zero where mask is 0."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = hf.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    B, T = targets.shape
    picked = hidden.gather(1, pred_pos[..., None].expand(B, T, hidden.shape[-1]))
    real = mask.bool()
    lp, ent = chunked_token_logprobs(picked[real], targets[real], hf.get_output_embeddings(), chunk, temperature)
    logp = torch.zeros(B, T, dtype=lp.dtype, device=lp.device).masked_scatter(real, lp)
    entropy = torch.zeros(B, T, dtype=ent.dtype, device=ent.device).masked_scatter(real, ent)
    return logp, entropy


def reference_logits_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Unchunked token logprobs from full logits: the definition the chunked path must equal."""
    return F.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None]).squeeze(-1)
