"""Token logprobs and entropy through a frozen LM head, chunked, as one autograd function.

The GRPO loss needs, per completion token, log p(target) with its gradient and the entropy as a metric.
Over a 151,936-token vocabulary the float32 logits of one step dwarf everything else, so they are never
kept: the forward makes them one chunk at a time and keeps only per-token results.

Gradient in the forward (the fused-linear-cross-entropy trick of Liger's FLCE): the head is frozen, so
the only gradient is the hidden states', and per token it is one scalar times a fixed vector,

    d loss / d hidden_i = (d loss / d logp_i) / T * (onehot(y_i) - softmax_i) @ weight

The vector needs the chunk's softmax, which the forward has anyway (for logz and the entropy); the scalar
comes from the loss later. So the forward keeps the vector per token ([N, H], the size of the hidden
states) and the backward is one product, instead of making every chunk's logits again (a second
vocabulary-sized GEMM and its softmax passes, about a sixth of a 1.5B model's learning step on an H200).
Against `torch.utils.checkpoint` around a log-softmax (what grpo.py did first) it also saves the recompute
of the forward and autograd's temporaries. The head weight must be frozen (LoRA does not target it) and
whole on this rank (not ZeRO-3 partitioned); grpo.chunked_token_logprobs falls back to the checkpointed
path otherwise.

Top-p (`grpo.top_p < 1`): vLLM samples from the nucleus of softmax(logits / T) and, under
`logprobs_mode="processed_logprobs"`, returns logprobs renormalised over that nucleus; the trainer must
use the same distribution or the importance ratio is biased by the dropped mass. `nucleus` applies
vLLM's rule (vllm/v1/sample/ops/topk_topp_sampler.py, apply_top_k_top_p_pytorch: temperature first,
sort ascending, drop the tokens whose ascending cumulative probability is <= 1 - top_p, always keep the
largest) with the same float32 ops, so on CPU the nucleus is bit-identical given identical logits (on
GPU vLLM 0.32 finds the same set with a Triton pivot search, topk_topp_triton.py: equal up to rounding
at the boundary). The softmax above then runs over the nucleus; the nucleus itself is treated as a
constant (it is piecewise constant in the logits, so its derivative is zero almost everywhere). Two
details:
- The sampled token always counts as inside: the engine sampled it, so it was in the engine's
  nucleus. When the trainer's logits put it outside (numerical differences between the engines at the
  boundary, or a policy that moved since the sample under async staleness), it is added to the nucleus:
  its probability is its mass over the nucleus plus itself, small when it is far outside, rather than
  0 (logp = -inf: a NaN gradient and an infinite KL).
- Ties at the boundary: vLLM keeps an arbitrary subset of the tokens tied with the smallest kept logit
  (those come in runs with bf16 logits). The normaliser is the same for every subset of that size;
  the gradient spreads the kept count evenly over the tied tokens (its expectation over the subsets).
The sort is done a bounded number of rows at a time (`_SORT_ELEMENTS`), so it adds a fixed ~1 GB at
most, not a multiple of the chunk's logits; the gradient then needs no sort (per token the smallest kept
logit and the tie weight) and no float temporary beyond the chunk's. Cost on one H200, vocabulary
151,936, 16,384 tokens in chunks of 4,096 (measured when the backward still made the logits again):
forward 0.38 s instead of 0.06 s (the sort), backward 0.08 s instead of 0.05 s, the same peak memory.

fp32 head (`model.fp32_head`, argument `fp32_head`): in a bf16 model the logits are a bf16 matmul's result,
rounded to bf16 (a step of 1/32 between 4 and 8), then upcast; each engine rounds its own slightly different
sums, which adds to the trainer/vLLM logprob mismatch (the literature's largest part on GPUs; on CPU with
Gemma 3 270M a sixth of it: mean |diff| 0.0236 -> 0.0199, benchmarks/results/fp32_head_cpu.json; the rest
comes from the decoders). With the option both compute the LM head with a float32 result, the way vLLM
does under `hf_overrides={"head_dtype": "float32"}`
(vllm/model_executor/layers/logits_processor.py `_apply_head`): on CUDA one bf16 GEMM with a float32
output (`torch.mm(out_dtype=)`, torch >= 2.10, no float32 copy of the weight), elsewhere both operands cast to float32
(a float32 copy of the weight, made once per forward, not per chunk). The gradient's product keeps the
weight's dtype (it is rounded to the hidden states' dtype anyway). A float32 model
is unchanged by the option.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# Elements (rows x vocab) sorted at once by `nucleus`: ~60 bytes each across its temporaries (measured).
_SORT_ELEMENTS = 1 << 24


def _fused_fp32_mm(h: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `torch.mm(out_dtype=float32)` applies: CUDA only (no CPU kernel in torch 2.13), half inputs, and
    no autograd through it (aten::mm.dtype has no derivative)."""
    return (h.is_cuda and h.dtype in (torch.bfloat16, torch.float16) and weight.dtype == h.dtype
            and not (torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)))


def head_weight(weight: torch.Tensor, h: torch.Tensor, fp32_head: bool) -> torch.Tensor:
    """The weight `head_logits` multiplies by, prepared once for many chunks: the float32 copy where the head
    runs in float32 by casting (see the module doc), else `weight` itself."""
    if fp32_head and h.dtype != torch.float32 and not _fused_fp32_mm(h, weight):
        return weight.float()
    return weight


def head_logits(h: torch.Tensor, weight: torch.Tensor, fp32_head: bool = False) -> torch.Tensor:
    """h [N, H] @ weight [V, H].T as float32 logits [N, V]. Default: the matmul in the model's dtype, then
    upcast (what HF's lm_head does). fp32_head: a float32 result with no half-precision rounding of the
    logits, as vLLM's `head_dtype=float32` computes it (module doc); `weight` may be `head_weight`'s copy."""
    if not fp32_head or h.dtype == torch.float32:
        return (h @ weight.t()).float()
    if _fused_fp32_mm(h, weight):
        return torch.mm(h, weight.t(), out_dtype=torch.float32)
    return F.linear(h.float(), weight.float())  # vLLM's cast path; .float() is free on head_weight's copy


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, temperature: float, fp32_head: bool = False
                  ) -> torch.Tensor:
    logits = head_logits(h, weight, fp32_head)
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


def nucleus(logits: torch.Tensor, targets: torch.Tensor, top_p: float
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [N, V] float32 (already over temperature), targets [N] -> per row (tau, tie_w, logz, entropy).

    tau: the smallest logit vLLM keeps; tie_w: the weight of each token tied at tau other than the
    target (kept count / tied count, 1 when no tie is cut); logz: log of the mass of the nucleus plus
    the target; entropy: of the distribution over that set. No gradient."""
    n, vocab = logits.shape
    thr = 1 - torch.tensor(top_p, dtype=torch.float32, device=logits.device)  # vLLM: float32 `1 - p`
    out = [torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(4)]
    rows = max(1, _SORT_ELEMENTS // max(vocab, 1))
    with torch.no_grad():
        for i in range(0, n, rows):
            x, y = logits[i:i + rows], targets[i:i + rows, None]
            srt, idx = x.sort(dim=-1)
            drop = srt.softmax(dim=-1).cumsum_(dim=-1) <= thr
            drop[:, -1] = False  # at least one
            tau = srt.gather(1, drop.sum(-1, keepdim=True))  # a prefix is dropped: the first kept
            tied = srt == tau
            n_tie, k_tie = tied.sum(-1), (tied & ~drop).sum(-1)
            ly = x.gather(1, y)
            # tie_w for the other tied tokens: k/n, or (k-1)/(n-1) when the target is one of the kept k
            tie_w = torch.where((ly.squeeze(1) == tau.squeeze(1)) & (k_tie < n_tie),
                                (k_tie - 1) / (n_tie - 1).clamp(min=1), k_tie / n_tie)
            drop &= ~((idx == y) & (ly < tau))  # the target always counts (see the module doc)
            kept = srt.masked_fill_(drop, float("-inf"))
            logz = torch.logsumexp(kept, dim=-1)
            lq = kept.sub_(logz[:, None])
            ent = -torch.where(drop, 0.0, lq.exp() * lq).sum(-1)
            for buf, v in zip(out, (tau.squeeze(1), tie_w.float(), logz, ent)):
                buf[i:i + rows] = v
    return out[0], out[1], out[2], out[3]


def nucleus_log_weights(logits: torch.Tensor, targets: torch.Tensor, tau: torch.Tensor,
                        tie_w: torch.Tensor) -> torch.Tensor:
    """[N, V] log-weights of the nucleus from `nucleus`'s (tau, tie_w): 0 inside, log tie_w on the tokens
    tied at tau, -inf outside, 0 on the target. logsumexp(logits + this) is the truncated log-normaliser
    with its gradient (the dense form, for grpo.py's checkpointed path)."""
    w = (logits > tau[:, None]).float()
    w.add_((logits == tau[:, None]) * tie_w[:, None])
    w.scatter_(1, targets[:, None], 1.0)
    return w.log_()


class HeadLogprobs(torch.autograd.Function):
    """(hidden [N, H], targets [N], weight [V, H]) -> (logp [N] float32, entropy [N] float32, no grad).

    The gradient is made in the forward (module doc, "Gradient in the forward"): per row it is the
    upstream scalar times d logp / d hidden, which the forward can form from the logits it has anyway;
    the backward is one [N, H] product, with no second pass over the vocabulary."""

    @staticmethod
    def forward(ctx, hidden, targets, weight, temperature: float, chunk: int, top_p: float = 1.0,
                fp32_head: bool = False):
        n = hidden.shape[0]
        w = head_weight(weight, hidden, fp32_head)
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logp)
        # d logp / d hidden, before the upstream gradient and 1/T: (onehot(y) - softmax) @ weight
        dlogp = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        for i in range(0, n, chunk):
            sl = slice(i, i + chunk)
            y = targets[sl, None]
            logits = _chunk_logits(hidden[sl], w, temperature, fp32_head)
            if top_p < 1.0:
                tau, tie_w, logz, entropy[sl] = nucleus(logits, targets[sl], top_p)
                logp[sl] = logits.gather(-1, y).squeeze(-1) - logz
                p = _nucleus_softmax_(logits, y, tau, tie_w, logz) if dlogp is not None else None
            else:
                logits.sub_(torch.logsumexp(logits, dim=-1)[:, None])  # now log-probabilities
                logp[sl] = logits.gather(-1, y).squeeze(-1)
                p = logits.exp()
                # H = -sum p log p, as a batched dot product (no product tensor is written)
                entropy[sl] = -torch.bmm(p.unsqueeze(1), logits.unsqueeze(2)).view(-1)
            del logits  # before the half-precision copy below: the peak stays two float32 chunks
            if dlogp is not None:
                p.neg_().scatter_add_(-1, y, torch.ones_like(y, dtype=p.dtype))
                dlogp[sl] = p.to(hidden.dtype) @ weight
            del p
        ctx.save_for_backward(dlogp)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        (dlogp,) = ctx.saved_tensors
        g = grad_logp.float() / ctx.temperature
        return (dlogp * g[:, None]).to(dlogp.dtype), None, None, None, None, None, None


def _nucleus_softmax_(logits, y, tau, tie_w, logz):
    """The softmax over the nucleus, in place of `logits` (bool masks are the only [N, V] temporaries)."""
    drop = logits < tau[:, None]
    ly = logits.gather(1, y)
    partial = tie_w < 1
    tied = (logits == tau[:, None]) & partial[:, None] if bool(partial.any()) else None
    p = logits.sub_(logz[:, None]).exp_().masked_fill_(drop, 0.0)
    if tied is not None:  # by index: masked_scatter_ would make an int64 prefix sum the size of the logits
        rows, cols = tied.nonzero(as_tuple=True)
        p[rows, cols] *= tie_w[rows]
    return p.scatter_(1, y, (ly - logz[:, None]).exp_())  # the target: always in, weight 1


def head_logprobs(hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, chunk: int,
                  temperature: float = 1.0, top_p: float = 1.0,
                  fp32_head: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return HeadLogprobs.apply(hidden, targets, weight, float(temperature), int(chunk), float(top_p), bool(fp32_head))
