"""PEFT's LoRA Linear with a cheaper forward for the trainer (registered through PEFT's custom-module API).

PEFT computes `result + lora_B(lora_A(x)) * scaling`: at rank r the two small GEMMs are cheap, but the
scaling multiply and the add each read and write a full [tokens, out_features] tensor, forward and
backward, on every targeted linear (7 per layer of a Qwen2 body: more elementwise traffic than the
rest of the layer). Here the scaling goes on the [tokens, r] activation and the update is added by the
GEMM itself (`addmm`, beta 1): same math, one rounding fewer, no full-width temporaries.

At rank 1 (the reference workload's) the adapter is an outer product, and a GEMM with an inner dimension
of 1 ran as a slow cutlass kernel on the H200 (11% of the trainer's GPU time; BENCHMARKS.md). There
`_Rank1Lora` owns the base product too: the update is a rank-1 `addr_` in place on the output, and in
backward on the input gradient the base product just made (no second [tokens, in] tensor to add), with
matrix-vector products for the rest.

When a call has at least as many rows (tokens) as the layer has inputs, as every training micro-batch
does, `_MergedLora` folds the adapter into a transient weight instead: W + s B A costs out x in x r, the
rank-r update on the output costs tokens x out x r plus a full read and write of the output, forward and
backward (the rank-1 `addr_` was 18% of the trainer's GPU time on the H200; BENCHMARKS.md). The forward and
the input gradient are then one GEMM each, as for the frozen base; the adapter's gradients come from
[tokens, r] products. The merged weight is rounded to the model dtype once per call: in bfloat16 its error
against a float32 reference is no larger than PEFT's (tests/test_lora_linear.py), and it is the weight the
engine serves in merge mode.

Same parameters, names and state dict as PEFT's class (it is a subclass), so checkpoints, publishing
and merging see no difference. Anything but plain single-adapter LoRA (DoRA and other variants, dropout,
merged or disabled adapters, extra forward arguments) takes PEFT's own forward. Under ZeRO-3 the
partitioned `lora_B` is called as a module so DeepSpeed's hooks gather it.
"""
from __future__ import annotations

import torch
from peft.tuners.lora.layer import Linear as PeftLoraLinear

# Merge the adapter into the call's weight when the call has at least this many rows per input feature.
MERGE_MIN_ROWS_PER_INPUT = 1.0


class _Rank1Lora(torch.autograd.Function):
    """y = x W^T + bias + s (x a) b^T for a frozen W and a rank-1 adapter (a: [in], b: [out]); x is 2-D."""

    @staticmethod
    def forward(ctx, x, weight, bias, a, b, scaling: float):
        h = torch.mv(x, a) * scaling
        y = torch.nn.functional.linear(x, weight, bias)
        y.addr_(h, b)
        ctx.save_for_backward(x, weight, a, b, h)
        ctx.scaling = scaling
        return y

    @staticmethod
    def backward(ctx, g):
        x, weight, a, b, h = ctx.saved_tensors
        g = g.contiguous()
        gh = torch.mv(g, b) * ctx.scaling
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = g @ weight
            grad_x.addr_(gh, a)
        grad_a = torch.mv(x.t(), gh) if ctx.needs_input_grad[3] else None
        grad_b = torch.mv(g.t(), h) if ctx.needs_input_grad[4] else None
        return grad_x, None, None, grad_a, grad_b, None


def _merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """W + s B A (a: [r, in], b: [out, r]) as a new tensor in W's dtype."""
    if a.shape[0] == 1:  # an inner dimension of 1 is a slow GEMM; as an outer product it is one pass
        return torch.addr(weight, b.view(-1), a.view(-1), alpha=scaling)
    return torch.addmm(weight, b, a, alpha=scaling)


class _MergedLora(torch.autograd.Function):
    """y = x (W + s B A)^T + bias for a frozen W (a: [r, in], b: [out, r]); x is 2-D. Nothing of the merged
    weight is kept for backward: it is merged again there (out x in x r, cheap next to the GEMMs)."""

    @staticmethod
    def forward(ctx, x, weight, bias, a, b, scaling: float):
        y = torch.nn.functional.linear(x, _merge(weight, a, b, scaling), bias)
        ctx.save_for_backward(x, weight, a, b)
        ctx.scaling = scaling
        return y

    @staticmethod
    def backward(ctx, g):
        x, weight, a, b = ctx.saved_tensors
        s = ctx.scaling
        g = g.contiguous()
        grad_x = g @ _merge(weight, a, b, s) if ctx.needs_input_grad[0] else None
        grad_a = grad_b = None
        if a.shape[0] == 1:  # matrix-vector products: no GEMM with an inner dimension of 1
            if ctx.needs_input_grad[3]:
                grad_a = torch.mv(x.t(), torch.mv(g, b.view(-1)) * s).view_as(a)
            if ctx.needs_input_grad[4]:
                grad_b = torch.mv(g.t(), torch.mv(x, a.view(-1)) * s).view_as(b)
        else:
            if ctx.needs_input_grad[3]:
                grad_a = (g @ b * s).t() @ x
            if ctx.needs_input_grad[4]:
                grad_b = g.t() @ (x @ a.t() * s)
        return grad_x, None, None, grad_a, grad_b, None


class FusedLoraLinear(PeftLoraLinear):
    def _plain_adapter(self) -> str | None:
        if self.disable_adapters or self.merged or len(self.active_adapters) != 1:
            return None
        name = self.active_adapters[0]
        if (name not in self.lora_A or name in self.lora_variant
                or not isinstance(self.lora_dropout[name], torch.nn.Identity)):
            return None
        return name

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        name = None if (args or kwargs) else self._plain_adapter()
        if name is None:
            return super().forward(x, *args, **kwargs)
        lora_a, lora_b = self.lora_A[name], self.lora_B[name]
        if self._own_product_ok(lora_a.weight, lora_b.weight, x):
            w, bias, s = self.base_layer.weight, self.base_layer.bias, float(self.scaling[name])
            x2 = x.reshape(-1, x.shape[-1])
            y = None
            if x2.shape[0] >= MERGE_MIN_ROWS_PER_INPUT * w.shape[1]:
                y = _MergedLora.apply(x2, w, bias, lora_a.weight, lora_b.weight, s)
            elif lora_a.weight.shape[0] == 1:
                y = _Rank1Lora.apply(x2, w, bias, lora_a.weight.view(-1), lora_b.weight.view(-1), s)
            if y is not None:
                return y.view(*x.shape[:-1], y.shape[-1])
        result = self.base_layer(x)
        h = lora_a(x.to(lora_a.weight.dtype)) * self.scaling[name]
        if getattr(lora_b.weight, "ds_id", None) is not None:  # ZeRO-3: let the module call gather B
            return result + lora_b(h).to(result.dtype)
        out = result.reshape(-1, result.shape[-1])
        out = torch.addmm(out, h.reshape(-1, h.shape[-1]).to(result.dtype), lora_b.weight.t().to(result.dtype))
        return out.view(result.shape)

    def _own_product_ok(self, a: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> bool:
        """The merged and rank-1 functions need a plain frozen torch Linear (not ZeRO-3-partitioned: they read
        the weight directly), one dtype throughout and no autocast."""
        base = self.base_layer
        return (type(base) is torch.nn.Linear and not base.weight.requires_grad
                and getattr(base.weight, "ds_id", None) is None and getattr(b, "ds_id", None) is None
                and x.dtype == a.dtype == b.dtype == base.weight.dtype and not torch.is_autocast_enabled())

    def __repr__(self) -> str:
        return "fused_" + super().__repr__()


def register(peft_config) -> None:
    """Have PEFT build FusedLoraLinear for every torch Linear this LoraConfig targets."""
    peft_config._register_custom_module({torch.nn.Linear: FusedLoraLinear})
