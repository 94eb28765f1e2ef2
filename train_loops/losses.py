"""Policy losses: one pure function each, registered by name (verl's `register_policy_loss`), chosen by
`grpo.loss`. The names and their help lines are `common/loss_names.py` (torch-free, so the config types
`grpo.loss` by them without loading torch); this module checks at import that its registry holds exactly those
names.

Every loss has one signature:

    fn(logp, behaviour_logp, mask, advantages, *, opts, ref_logp=None, entropy=None,
       token_denominator, seq_denominator) -> (loss, stats)

- `logp` [B, T]: the trainer's token logprobs (with grad); `behaviour_logp` [B, T]: vLLM's, for the sampled
  tokens; `mask` [B, T]: 1 on real completion tokens (right-padded); `advantages` [B] or [B, T].
- `opts`: the `GRPOConfig` (each loss reads its own typed fields: clip_eps_*, gspo_*, cispo_*, dapo_*, ...).
- `ref_logp` [B, T]: base-policy logprobs; then `opts.kl_coef` x k3 KL is added per token.
- `entropy` [B, T] (detached): only reported.
- `token_denominator`, `seq_denominator`: the STEP's completion tokens / world size and the step's sequences
  / world size. A micro-batch's loss is a sum over its tokens (or sequences) divided by these, never a mean
  over the micro-batch, so the micro-batch losses of a step add up to the same total for any split into
  micro-batches and ranks (the data-parallel average divides by the world size once more).

`stats` are floats over this micro-batch's real tokens: clip_frac, log_ratio_abs_mean (|logp - behaviour|),
log_ratio_abs_max, kl, tokens, and entropy / tis_weight_mean / tis_clip_frac when they apply.

Adding a loss: its name and one help line in `common/loss_names.py`, its options in `GRPOConfig`
(checked by `GRPOConfig.problems`), and a function here under `@register_policy_loss(name)`.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from common.config import LOSS_AGGS
from common.loss_names import LOSS_NAMES

PolicyLoss = Callable[..., tuple[torch.Tensor, dict]]

_REGISTRY: dict[str, PolicyLoss] = {}

# The reducers `agg_loss` knows: the user-facing `grpo.loss_agg` modes plus Dr. GRPO's constant normaliser.
AGG_MODES = LOSS_AGGS + ("seq-mean-token-sum-norm",)


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator: register `fn` as the policy loss `name` (which must be in common.loss_names)."""
    if name not in LOSS_NAMES:
        raise ValueError(f"policy loss {name!r} is not in common.loss_names.POLICY_LOSSES; add it there first")

    def deco(fn: PolicyLoss) -> PolicyLoss:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"policy loss {name!r} is registered twice")
        _REGISTRY[name] = fn
        return fn

    return deco


def get_policy_loss(name: str) -> PolicyLoss:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"grpo.loss: {name!r} is not one of {', '.join(_REGISTRY)}") from None


# ---------------------------------------------------------------- shared pieces

def agg_loss(per_token: torch.Tensor, mask: torch.Tensor, mode: str, *, token_denominator,
             seq_denominator, norm_len: float | None = None) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to this micro-batch's share of the step's loss.

    token-mean:              sum over real tokens / token_denominator
    seq-mean-token-mean:     sum over sequences of (token sum / its own length) / seq_denominator
    seq-mean-token-sum:      sum over sequences of token sum / seq_denominator
    seq-mean-token-sum-norm: sum over sequences of token sum / (norm_len x seq_denominator)   (Dr. GRPO)
    """
    real = mask.bool()
    tok = torch.where(real, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
    if mode == "token-mean":
        return tok.sum() / token_denominator
    seq = tok.sum(dim=1)
    if mode == "seq-mean-token-mean":
        seq = seq / real.sum(dim=1).clamp(min=1).to(seq.dtype)
    elif mode == "seq-mean-token-sum-norm":
        if not norm_len:
            raise ValueError("seq-mean-token-sum-norm needs norm_len")
        seq = seq / norm_len
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"loss_agg {mode!r} is not one of {AGG_MODES}")
    return seq.sum() / seq_denominator


def _inputs(logp, behaviour_logp, mask, advantages):
    """(real [B,T] bool, maskf, advantages [B,T]-broadcastable, log_ratio vs behaviour, 0 on padding)."""
    real = mask.bool()
    maskf = mask.to(logp.dtype)
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    adv = advantages.to(logp.dtype)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    log_ratio = torch.where(real, logp - behaviour_logp.to(logp.dtype), zero)
    return real, maskf, adv, log_ratio


def _kl(logp, ref_logp, real):
    """k3 estimator exp(ref - logp) - (ref - logp) - 1 per token (0 on padding), or None."""
    if ref_logp is None:
        return None
    d = torch.where(real, ref_logp.to(logp.dtype) - logp, torch.zeros((), dtype=logp.dtype, device=logp.device))
    return torch.exp(d) - d - 1.0


def _add_kl(per_token, kl_tok, opts):
    return per_token + opts.kl_coef * kl_tok if kl_tok is not None and opts.kl_coef else per_token


@torch.no_grad()
def _stats(log_ratio, real, maskf, clip_hit, kl_tok, entropy) -> dict:
    n = maskf.sum().clamp(min=1.0)
    abs_lr = log_ratio.detach().abs()
    stats = {
        "clip_frac": float((clip_hit.to(maskf.dtype) * maskf).sum() / n),
        "log_ratio_abs_mean": float((abs_lr * maskf).sum() / n),
        "log_ratio_abs_max": float(abs_lr[real].max()) if real.any() else 0.0,
        "kl": float((kl_tok.detach() * maskf).sum() / n) if kl_tok is not None else 0.0,
        "tokens": int(maskf.sum()),
    }
    if entropy is not None:
        stats["entropy"] = float((entropy.to(maskf.dtype) * maskf).sum() / n)
    return stats


def _clipped_surrogate(logp, log_ratio, adv, maskf, eps_low: float, eps_high: float, tis_cap: float | None):
    """Per-token PPO surrogate -min(r A, clip(r, 1-lo, 1+hi) A) against the behaviour policy.

    With `tis_cap` (truncated importance sampling, the decoupled form of Yao et al. 2025 / verl): the
    proximal policy is the trainer's own sg(pi), so r = exp(logp - sg(logp)) (value 1, gradient d logp),
    and the trainer/sampler mismatch is corrected by the detached w = min(exp(logp - behaviour), tis_cap).
    `clip_hit` always reports the ratio against the behaviour policy."""
    if tis_cap is None:
        ratio, weight = torch.exp(log_ratio), None
    else:
        ratio = torch.exp(logp - logp.detach())
        weight = torch.exp(log_ratio.detach()).clamp(max=tis_cap)
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    extra = {}
    with torch.no_grad():
        r_b = torch.exp(log_ratio.detach())
        clip_hit = ((r_b > 1.0 + eps_high) & (adv > 0)) | ((r_b < 1.0 - eps_low) & (adv < 0))
        if weight is not None:
            n = maskf.sum().clamp(min=1.0)
            extra["tis_weight_mean"] = float((weight * maskf).sum() / n)
            extra["tis_clip_frac"] = float(((r_b > tis_cap).to(maskf.dtype) * maskf).sum() / n)
    if weight is not None:
        per_token = per_token * weight
    return per_token, clip_hit, extra


def _surrogate_loss(logp, behaviour_logp, mask, advantages, opts, ref_logp, entropy, eps_low, eps_high, mode,
                    token_denominator, seq_denominator, norm_len=None):
    real, maskf, adv, log_ratio = _inputs(logp, behaviour_logp, mask, advantages)
    per_token, clip_hit, extra = _clipped_surrogate(logp, log_ratio, adv, maskf, eps_low, eps_high, opts.tis_cap)
    kl_tok = _kl(logp, ref_logp, real)
    loss = agg_loss(_add_kl(per_token, kl_tok, opts), mask, mode, token_denominator=token_denominator,
                    seq_denominator=seq_denominator, norm_len=norm_len)
    return loss, {**_stats(log_ratio, real, maskf, clip_hit, kl_tok, entropy), **extra}


# ---------------------------------------------------------------- the losses

@register_policy_loss("grpo")
def grpo(logp, behaviour_logp, mask, advantages, *, opts, ref_logp=None, entropy=None,
         token_denominator, seq_denominator):
    """GRPO: the clipped surrogate per token at clip_eps_low/high (optionally truncated-IS, `tis_cap`),
    reduced by `opts.loss_agg`."""
    return _surrogate_loss(logp, behaviour_logp, mask, advantages, opts, ref_logp, entropy, opts.clip_eps_low,
                           opts.clip_eps_high, opts.loss_agg, token_denominator, seq_denominator)


@register_policy_loss("dr_grpo")
def dr_grpo(logp, behaviour_logp, mask, advantages, *, opts, ref_logp=None, entropy=None,
            token_denominator, seq_denominator):
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"): the GRPO surrogate with each
    sequence's token SUM divided by a constant (`dr_grpo_norm_len`, default max_new_tokens) instead of its
    own length, then the mean over sequences: no length bias. Its other half, advantages not divided by the
    group std, is upstream (`Config.scale_advantages` is False under this loss)."""
    norm_len = opts.dr_grpo_norm_len or opts.max_new_tokens
    return _surrogate_loss(logp, behaviour_logp, mask, advantages, opts, ref_logp, entropy, opts.clip_eps_low,
                           opts.clip_eps_high, "seq-mean-token-sum-norm", token_denominator, seq_denominator,
                           norm_len=norm_len)


@register_policy_loss("dapo")
def dapo(logp, behaviour_logp, mask, advantages, *, opts, ref_logp=None, entropy=None,
         token_denominator, seq_denominator):
    """DAPO's loss (Yu et al. 2025): the clipped surrogate with clip-higher (dapo_clip_eps_low/high,
    0.2/0.28) and a token-level mean over the whole step. Its dynamic sampling and overlong reward shaping
    are on the rollout side (grpo.dynamic_sampling, grpo.dapo_overlong_buffer)."""
    return _surrogate_loss(logp, behaviour_logp, mask, advantages, opts, ref_logp, entropy, opts.dapo_clip_eps_low,
                           opts.dapo_clip_eps_high, "token-mean", token_denominator, seq_denominator)


@register_policy_loss("gspo")
def gspo(logp, behaviour_logp, mask, advantages, *, opts, ref_logp=None, entropy=None,
         token_denominator, seq_denominator):
    """GSPO (Zheng et al. 2025, Qwen): the importance ratio of a whole sequence,
    s_i = exp(mean over its tokens of (logp - behaviour_logp)), clipped per sequence at
    1 -/+ gspo_clip_eps_low/high. GSPO-token form: s_i,t = sg(s_i) * exp(logp_t - sg(logp_t)) has the value
    s_i and the gradient s_i * d logp_t, so per-token advantages are allowed; per-token loss
    -min(s_i,t A, clip(s_i,t) A), mean over each sequence's tokens, then over sequences. With one
    advantage per sequence this is exactly the gradient of the sequence-level objective."""
    real, maskf, adv, log_ratio = _inputs(logp, behaviour_logp, mask, advantages)
    lengths = maskf.sum(dim=1).clamp(min=1.0)
    seq_log_ratio = (log_ratio * maskf).sum(dim=1) / lengths  # [B]
    s_tok = torch.exp(seq_log_ratio.detach()[:, None] + logp - logp.detach())
    clipped = s_tok.clamp(1.0 - opts.gspo_clip_eps_low, 1.0 + opts.gspo_clip_eps_high)
    per_token = -torch.minimum(s_tok * adv, clipped * adv)
    kl_tok = _kl(logp, ref_logp, real)
    loss = agg_loss(_add_kl(per_token, kl_tok, opts), mask, "seq-mean-token-mean",
                    token_denominator=token_denominator, seq_denominator=seq_denominator)
    with torch.no_grad():
        s = torch.exp(seq_log_ratio.detach())[:, None]
        clip_hit = ((s > 1.0 + opts.gspo_clip_eps_high) & (adv > 0)) | ((s < 1.0 - opts.gspo_clip_eps_low) & (adv < 0))
        clip_hit = clip_hit.expand_as(maskf)
        stats = _stats(log_ratio, real, maskf, clip_hit, kl_tok, entropy)
        seqs = real.any(dim=1)
        stats["seq_log_ratio_abs_mean"] = float(seq_log_ratio.detach().abs()[seqs].mean()) if seqs.any() else 0.0
    return loss, stats


@register_policy_loss("cispo")
def cispo(logp, behaviour_logp, mask, advantages, *, opts, ref_logp=None, entropy=None,
          token_denominator, seq_denominator):
    """CISPO (MiniMax-M1, 2025): REINFORCE with the clipped, detached importance weight,
    per-token loss -sg(clip(r, 1 - cispo_eps_low, 1 + cispo_eps_high)) * A * logp, r = exp(logp - behaviour).
    Clipping bounds the weight, never drops a token's gradient (unlike the PPO min). `opts.loss_agg`
    reduces it (token-mean is the paper's)."""
    real, maskf, adv, log_ratio = _inputs(logp, behaviour_logp, mask, advantages)
    r = torch.exp(log_ratio.detach())
    lo, hi = 1.0 - opts.cispo_eps_low, 1.0 + opts.cispo_eps_high
    weight = r.clamp(lo, hi)
    safe_logp = torch.where(real, logp, torch.zeros((), dtype=logp.dtype, device=logp.device))
    per_token = -weight * adv * safe_logp
    kl_tok = _kl(logp, ref_logp, real)
    loss = agg_loss(_add_kl(per_token, kl_tok, opts), mask, opts.loss_agg,
                    token_denominator=token_denominator, seq_denominator=seq_denominator)
    with torch.no_grad():
        stats = _stats(log_ratio, real, maskf, (r > hi) | (r < lo), kl_tok, entropy)
        n = maskf.sum().clamp(min=1.0)
        stats["is_weight_mean"] = float((weight * maskf).sum() / n)
    return loss, stats


# One source of truth, checked: the names `grpo.loss` accepts are exactly what is registered here.
if set(_REGISTRY) != set(LOSS_NAMES):
    raise RuntimeError(f"train_loops.losses registers {sorted(_REGISTRY)} but common.loss_names lists "
                       f"{sorted(LOSS_NAMES)}")

LOSSES: tuple[str, ...] = LOSS_NAMES
