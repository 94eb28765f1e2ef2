"""The module DeepSpeed wraps: the PEFT model plus a forward that returns completion-token logprobs.

Going through `engine(batch)` (not the PEFT model's submodules directly) keeps DeepSpeed's ZeRO-3
parameter fetch/release hooks and engine bookkeeping on the path that computes the loss."""
from __future__ import annotations

import contextlib

import torch

from train_loops.grpo import sequence_logprobs


class PolicyLogprobs(torch.nn.Module):
    def __init__(self, peft_model, chunk: int, temperature: float = 1.0, top_p: float = 1.0,
                 fp32_head: bool = False):
        super().__init__()
        self.policy = peft_model
        self.chunk = chunk
        self.temperature = temperature
        self.top_p = top_p  # the reference forward (disable_adapter) too: see grpo.sequence_logprobs
        self.fp32_head = fp32_head  # model.fp32_head, both forwards: the engines' head runs in float32 too

    def forward(self, input_ids, attention_mask, pred_pos, targets, mask, disable_adapter: bool = False):
        ctx = self.policy.disable_adapter() if disable_adapter else contextlib.nullcontext()
        with ctx:
            return sequence_logprobs(self.policy, input_ids, attention_mask, pred_pos, targets, mask,
                                     self.chunk, self.temperature, self.top_p, self.fp32_head)
