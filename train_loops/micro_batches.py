"""How one optimizer step's sequences are cut into micro-batches: by a token budget over their real
lengths, not by a fixed count (nobody can guess a `grad_accum` for completions of 10 to 3,000 tokens).

1. `assign_ranks`: sequences go to ranks longest first in snake order, so every rank gets the same
   number of sequences (+-1) and about the same number of tokens.
2. `pack`: on each rank, longest first, a micro-batch takes sequences while its padded size
   (sequences x longest) stays within the budget. Sorting also buckets by length: little padding.
3. `equalize`: ZeRO-2/3 reduce gradients inside every backward, so all ranks must run the same number
   of backwards; ranks with fewer micro-batches split their largest ones.

The loss stays exact for any split because every micro-batch's loss is a sum over its tokens (or
sequences) divided by the step's totals (`step_denominators`), never a mean over the micro-batch.
"""
from __future__ import annotations

from common.types import Sample

CPU_DEFAULT_BUDGET = 16384


def seq_len(s: Sample) -> int:
    return len(s.prompt_ids) + len(s.completion_ids)


def assign_ranks(samples: list[Sample], world: int) -> list[list[Sample]]:
    order = sorted(range(len(samples)), key=lambda i: -seq_len(samples[i]))
    ranks: list[list[Sample]] = [[] for _ in range(world)]
    for k, i in enumerate(order):
        lap, pos = divmod(k, world)
        ranks[pos if lap % 2 == 0 else world - 1 - pos].append(samples[i])
    return ranks


def padded_tokens(batch: list[Sample]) -> int:
    return len(batch) * max((seq_len(s) for s in batch), default=0)


def pack(samples: list[Sample], budget: int) -> list[list[Sample]]:
    """Greedy, longest first; a sequence longer than the budget still gets a micro-batch of its own
    (config validation keeps the budget >= max_model_len, so that cannot happen in a run)."""
    out: list[list[Sample]] = []
    for s in sorted(samples, key=lambda s: -seq_len(s)):
        if out and (len(out[-1]) + 1) * seq_len(out[-1][0]) <= budget:
            out[-1].append(s)
        else:
            out.append([s])
    return out


def equalize(micro: list[list[Sample]], n: int) -> list[list[Sample]]:
    """Split the largest micro-batches until there are `n` (or every one holds one sequence)."""
    micro = [list(m) for m in micro]
    while len(micro) < n:
        i = max(range(len(micro)), key=lambda j: (len(micro[j]) > 1, padded_tokens(micro[j])))
        if len(micro[i]) < 2:
            break
        m = micro.pop(i)
        micro[i:i] = [m[:len(m) // 2], m[len(m) // 2:]]
    return micro


def step_denominators(rank_samples: list[list[Sample]]) -> tuple[float, float]:
    """(tokens, sequences) of the whole step, each divided by the world size: the data-parallel
    gradient average divides by the world size again, so the result is the mean over the step."""
    world = len(rank_samples)
    tokens = sum(s.sampled_tokens for r in rank_samples for s in r)
    seqs = sum(len(r) for r in rank_samples)
    return max(tokens, 1) / world, max(seqs, 1) / world


def activation_bytes_per_token(hf_config, dtype_bytes: int, gradient_checkpointing: bool,
                               liger: bool = False) -> float:
    """What one token of one sequence keeps for backward in a LoRA-on-all-linear decoder, per layer
    (counted with saved-tensor hooks in tests/test_micro_batches.py, on a real PEFT model in the dtype
    DeepSpeed casts it to):
    - HF's layers keep about 9 x hidden (the two RMSNorms' inputs with their float32 copies, q/k/v, the
      attention output) plus 4 x intermediate (gate, its SiLU, up, their product), plus a few per-row
      statistics;
    - Liger's RMSNorm keeps no float32 copy and its SwiGLU recomputes the SiLU: 6 x hidden + 3 x
      intermediate. Triton has no CPU backend, so this one is from the H200's peak memory (45.6 GiB with
      Liger, 57.6 without, at 19.5k tokens of the 1.5B shape; results/gpu_pipeline_2026-12-01.json).
    With checkpointing, only each layer's input stays, plus one layer's worth while it is recomputed."""
    h = hf_config.hidden_size
    i = getattr(hf_config, "intermediate_size", 4 * h)
    layers = hf_config.num_hidden_layers
    heads = getattr(hf_config, "num_attention_heads", 1)
    # + per-row statistics: the norms' rstd, attention's logsumexp per head, the LoRA rank-r activations
    per_layer = ((6 * h + 3 * i) if liger else (9 * h + 4 * i)) * dtype_bytes + 4 * heads + 256
    if gradient_checkpointing:
        return layers * h * dtype_bytes + per_layer
    return layers * per_layer


def auto_budget(hf_config, device, dtype_bytes: int, gradient_checkpointing: bool, max_model_len: int,
                logprob_chunk: int, headroom: float = 0.5, liger: bool = False) -> int:
    """Tokens per micro-batch that fit in `headroom` of the device's free memory (after the model and,
    on a shared GPU, the vLLM engine took theirs): at least one sequence, at most 262,144. On CPU a
    fixed CPU_DEFAULT_BUDGET. Ranks may see different free memory: the caller takes the minimum."""
    import torch

    if device.type != "cuda":
        return max(CPU_DEFAULT_BUDGET, max_model_len)
    free, _ = torch.cuda.mem_get_info(device)
    # The chunked log-softmax holds one chunk of float32 logits (and its grad) at a time.
    free -= 3 * logprob_chunk * hf_config.vocab_size * 4
    per_token = activation_bytes_per_token(hf_config, dtype_bytes, gradient_checkpointing, liger)
    budget = int(headroom * max(free, 0) / per_token)
    return max(max_model_len, min(budget, 262_144))


def plan(rank_samples: list[list[Sample]], rank: int, budget: int, n_micro: int | None = None) -> list[list[Sample]]:
    """This rank's micro-batches; with `n_micro` (the max over ranks) equalized to that count."""
    micro = pack(rank_samples[rank], budget)
    return equalize(micro, n_micro) if n_micro is not None else micro


def micro_batches_needed(rank_samples: list[list[Sample]], budget: int) -> int:
    """The number every rank must run: the largest any rank needs (pure, so every rank agrees)."""
    return max((len(pack(r, budget)) for r in rank_samples), default=1) or 1

