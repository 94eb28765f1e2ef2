"""GRPO math: group-relative advantages, token logprobs computed in chunks so a full-vocabulary float32
log-softmax over the whole batch never exists at once, and `grpo_loss`, a keyword wrapper over the `grpo`
loss of the registry in train_loops/losses.py (where every policy loss lives).

Shapes: B sequences, T completion positions (right-padded), `mask[b, t] = 1` on real completion tokens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from common.config import GRPOConfig, LossAgg
from train_loops.head_logprobs import head_logits, head_logprobs, nucleus, nucleus_log_weights
from train_loops.losses import agg_loss, get_policy_loss

__all__ = ["aggregate", "group_advantages", "grpo_loss", "chunked_token_logprobs",
           "sequence_logprobs", "reference_logits_logprobs"]


def group_advantages(rewards: torch.Tensor, scale_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """rewards [P, G] -> advantages [P, G]: reward minus the group mean, divided by the group std
    (unbiased, like the GRPO paper) unless `scale_by_std=False` (Dr. GRPO)."""
    rewards = rewards.float()
    adv = rewards - rewards.mean(dim=1, keepdim=True)
    if scale_by_std:
        adv = adv / (rewards.std(dim=1, keepdim=True) + eps)
    return adv


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_agg: LossAgg,
              token_denominator: float | None = None, seq_denominator: float | None = None) -> torch.Tensor:
    """`losses.agg_loss` with this micro-batch's own token / sequence counts where a denominator is None."""
    token_denominator, seq_denominator = _own_denominators(mask, per_token.dtype, token_denominator, seq_denominator)
    return agg_loss(per_token, mask, loss_agg, token_denominator=token_denominator, seq_denominator=seq_denominator)


def _own_denominators(mask, dtype, token_denominator, seq_denominator):
    if token_denominator is None:
        token_denominator = mask.to(dtype).sum().clamp(min=1.0)
    if seq_denominator is None:
        seq_denominator = max(mask.shape[0], 1)
    return token_denominator, seq_denominator


def grpo_loss(logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor, *,
              clip_eps_low: float, clip_eps_high: float, loss_agg: LossAgg = "token-mean", kl_coef: float = 0.0,
              ref_logp: torch.Tensor | None = None, tis_cap: float | None = None,
              entropy: torch.Tensor | None = None, token_denominator: float | None = None,
              seq_denominator: float | None = None) -> tuple[torch.Tensor, dict]:
    """The registry's `grpo` loss (see train_loops/losses.py) with its options as keywords.

    Without TIS: r = exp(logp - behaviour_logp), per-token loss -min(r*A, clip(r, 1-lo, 1+hi)*A). With
    `tis_cap`: truncated-IS REINFORCE, -min(exp(logp - logp.detach()), ...) * A * min(exp(logp - behaviour),
    tis_cap). KL: k3 to `ref_logp`, added as kl_coef * KL. `token_denominator` / `seq_denominator`: the
    step's tokens / sequences per rank; None = this micro-batch's own count (a mean over the micro-batch)."""
    opts = GRPOConfig(clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high, loss_agg=loss_agg, kl_coef=kl_coef,
                      tis_cap=tis_cap)
    token_denominator, seq_denominator = _own_denominators(mask, logp.dtype, token_denominator, seq_denominator)
    return get_policy_loss("grpo")(logp, behaviour_logp, mask, advantages, opts=opts, ref_logp=ref_logp,
                                   entropy=entropy, token_denominator=token_denominator,
                                   seq_denominator=seq_denominator)


def _module_logits(hidden: torch.Tensor, lm_head: torch.nn.Module, fp32_head: bool) -> torch.Tensor:
    """float32 logits of any LM head module; with `fp32_head` a linear head's matmul has a float32 result
    (train_loops/head_logprobs.py `head_logits`). A ZeRO-3 partitioned head is refused with the option: only
    the module call gathers it, and that computes in the weight's dtype (gathering it by hand inside the
    forward fails for a head tied to the input embedding, which is still active: DeepSpeed 0.19)."""
    if not fp32_head or hidden.dtype == torch.float32:
        return lm_head(hidden).float()
    weight, bias = getattr(lm_head, "weight", None), getattr(lm_head, "bias", None)
    if weight is None:
        raise ValueError(f"model.fp32_head: the LM head {type(lm_head).__name__} has no weight to multiply by")
    if any(getattr(p, "ds_id", None) is not None for p in (weight, bias) if p is not None):
        raise ValueError("model.fp32_head: not with a ZeRO-3 partitioned LM head (train.zero_stage 3); use "
                         "zero_stage 2, or model.dtype float32, where the head is float32 already")
    logits = head_logits(hidden, weight, fp32_head=True)
    return logits if bias is None else logits + bias.float()


def _chunk_logprobs(hidden: torch.Tensor, targets: torch.Tensor, lm_head: torch.nn.Module, temperature: float,
                    top_p: float = 1.0, fp32_head: bool = False):
    logits = _module_logits(hidden, lm_head, fp32_head)
    if temperature != 1.0:
        logits = logits / temperature
    if top_p < 1.0:  # the nucleus vLLM sampled from: see train_loops/head_logprobs.py
        with torch.no_grad():
            tau, tie_w, _, entropy = nucleus(logits, targets, top_p)
            log_w = nucleus_log_weights(logits, targets, tau, tie_w)
        logz = torch.logsumexp(logits + log_w, dim=-1)
        return logits.gather(-1, targets[:, None]).squeeze(-1) - logz, entropy
    logz = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - logz
    with torch.no_grad():
        probs_logp = logits - logz[:, None]
        entropy = -(probs_logp.exp() * probs_logp).sum(-1)
    return logp, entropy


def chunked_token_logprobs(hidden: torch.Tensor, targets: torch.Tensor, lm_head: torch.nn.Module,
                           chunk: int, temperature: float = 1.0, top_p: float = 1.0,
                           fp32_head: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [N, H], targets [N] -> (logp [N] with grad, entropy [N] detached), both under the
    distribution vLLM samples from: softmax(logits / temperature), truncated to the top-p nucleus when
    top_p < 1 (train_loops/head_logprobs.py). `fp32_head` (model.fp32_head): the head's logits have a
    float32 result, as vLLM's under `head_dtype=float32` (train_loops/head_logprobs.py).

    Peak memory is one chunk x vocab in float32: a frozen, unpartitioned, bias-free head goes through
    train_loops/head_logprobs.py (logits made again in the backward and turned into the gradient in
    place); any other head runs each chunk under activation checkpointing."""
    weight = getattr(lm_head, "weight", None)
    if (torch.is_grad_enabled() and hidden.requires_grad and weight is not None and not weight.requires_grad
            and getattr(lm_head, "bias", None) is None and getattr(weight, "ds_id", None) is None
            and hidden.shape[0]):
        return head_logprobs(hidden, targets, weight, chunk, temperature, top_p, fp32_head)
    logps, ents = [], []
    for i in range(0, hidden.shape[0], chunk):
        h, y = hidden[i:i + chunk], targets[i:i + chunk]
        if torch.is_grad_enabled() and h.requires_grad:
            lp, ent = checkpoint(_chunk_logprobs, h, y, lm_head, temperature, top_p, fp32_head, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(h, y, lm_head, temperature, top_p, fp32_head)
        logps.append(lp)
        ents.append(ent)
    if not logps:
        z = hidden.new_zeros(0, dtype=torch.float32)
        return z, z
    return torch.cat(logps), torch.cat(ents)


def sequence_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, pred_pos: torch.Tensor,
                      targets: torch.Tensor, mask: torch.Tensor, chunk: int,
                      temperature: float = 1.0, top_p: float = 1.0,
                      fp32_head: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Token logprobs of the completion tokens only, under the sampling distribution (temperature, top-p),
    the LM head in float32 when `fp32_head` (model.fp32_head; the reference forward of the KL term too).

    `model` is a HF causal LM (or a PEFT wrapper of one); its decoder runs once over the full sequences,
    then only the hidden states at `pred_pos` (the position predicting each completion token) go
    through the LM head, chunked. Returns (logp [B, T], entropy [B, T]), zero where mask is 0.

    The reference forward of the KL term (adapter disabled) must get the same top_p: truncated to the
    base model's own nucleus, the KL compares the distributions the two policies would sample from and
    is exactly 0 while the adapter is a no-op. A full-softmax reference against a truncated policy would
    not be: logp_trunc >= logp_full always, so k3 would be positive at init and its gradient would push
    every sampled token's probability down."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = hf.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    B, T = targets.shape
    picked = hidden.gather(1, pred_pos[..., None].expand(B, T, hidden.shape[-1]))
    real = mask.bool()
    lp, ent = chunked_token_logprobs(picked[real], targets[real], hf.get_output_embeddings(), chunk, temperature,
                                     top_p, fp32_head)
    logp = torch.zeros(B, T, dtype=lp.dtype, device=lp.device).masked_scatter(real, lp)
    entropy = torch.zeros(B, T, dtype=ent.dtype, device=ent.device).masked_scatter(real, ent)
    return logp, entropy


def reference_logits_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Unchunked token logprobs from full logits: the definition the chunked path must equal."""
    return F.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None]).squeeze(-1)
