"""Token logprobs and entropy through a frozen LM head, chunked, as one autograd function.

The GRPO loss needs, per completion token, log p(target) with its gradient and the entropy as a metric.
Over a 151,936-token vocabulary the float32 logits of one step dwarf everything else, so they are never
kept: the forward makes them one chunk at a time and keeps only `logz` per token; the backward makes
each chunk's logits again and turns them into the gradient in place:

    d logp(y) / d logits = onehot(y) - softmax(logits)     (times the incoming grad, over temperature)

Against `torch.utils.checkpoint` around a log-softmax (what grpo.py did before) this saves the
recompute of the forward (logsumexp and the entropy a second time) and autograd's temporaries: about
half the full-vocabulary passes. The head weight must be frozen (LoRA does not target it) and whole on
this rank (not ZeRO-3 partitioned); grpo.chunked_token_logprobs falls back to the checkpointed path
otherwise.
"""
from __future__ import annotations

import torch


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = (h @ weight.t()).float()
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


class HeadLogprobs(torch.autograd.Function):
    """(hidden [N, H], targets [N], weight [V, H]) -> (logp [N] float32, entropy [N] float32, no grad)."""

    @staticmethod
    def forward(ctx, hidden, targets, weight, temperature: float, chunk: int):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logp)
        logz = torch.empty_like(logp)
        for i in range(0, n, chunk):
            logits = _chunk_logits(hidden[i:i + chunk], weight, temperature)
            z = torch.logsumexp(logits, dim=-1)
            logz[i:i + chunk] = z
            logits.sub_(z[:, None])  # now log-probabilities
            logp[i:i + chunk] = logits.gather(-1, targets[i:i + chunk, None]).squeeze(-1)
            # H = -sum p log p, as a batched dot product (no product tensor is written)
            entropy[i:i + chunk] = -torch.bmm(logits.exp().unsqueeze(1), logits.unsqueeze(2)).view(-1)
        ctx.save_for_backward(hidden, targets, weight, logz)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, targets, weight, logz = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        grad_hidden = torch.empty_like(hidden)
        g_all = grad_logp.float() / t
        for i in range(0, hidden.shape[0], chunk):
            h, y, g = hidden[i:i + chunk], targets[i:i + chunk], g_all[i:i + chunk]
            p = _chunk_logits(h, weight, t).sub_(logz[i:i + chunk, None]).exp_()  # softmax
            p.mul_(-g[:, None])
            p.scatter_add_(-1, y[:, None], g[:, None])  # (onehot - softmax) * g / T
            grad_hidden[i:i + chunk] = p.to(hidden.dtype) @ weight
        return grad_hidden, None, None, None, None


def head_logprobs(hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, chunk: int,
                  temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    return HeadLogprobs.apply(hidden, targets, weight, float(temperature), int(chunk))
