"""PEFT's LoRA Linear with a cheaper forward for the trainer (registered through PEFT's custom-module API).

PEFT computes `result + lora_B(lora_A(x)) * scaling`: at rank r the two small GEMMs are cheap, but the
scaling multiply and the add each read and write a full [tokens, out_features] tensor, forward and
backward, on every targeted linear (7 per layer of a Qwen2 body: more elementwise traffic than the
rest of the layer). Here the scaling goes on the [tokens, r] activation and the update is added by the
GEMM itself (`addmm`, beta 1): same math, one rounding fewer, no full-width temporaries.

Same parameters, names and state dict as PEFT's class (it is a subclass), so checkpoints, publishing
and merging see no difference. Anything but plain single-adapter LoRA (DoRA and other variants, dropout,
merged or disabled adapters, extra forward arguments) takes PEFT's own forward. Under ZeRO-3 the
partitioned `lora_B` is called as a module so DeepSpeed's hooks gather it.
"""
from __future__ import annotations

import torch
from peft.tuners.lora.layer import Linear as PeftLoraLinear


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
        result = self.base_layer(x)
        h = lora_a(x.to(lora_a.weight.dtype)) * self.scaling[name]
        if getattr(lora_b.weight, "ds_id", None) is not None:  # ZeRO-3: let the module call gather B
            return result + lora_b(h).to(result.dtype)
        out = result.reshape(-1, result.shape[-1])
        out = torch.addmm(out, h.reshape(-1, h.shape[-1]).to(result.dtype), lora_b.weight.t().to(result.dtype))
        return out.view(result.shape)

    def __repr__(self) -> str:
        return "fused_" + super().__repr__()


def register(peft_config) -> None:
    """Have PEFT build FusedLoraLinear for every torch Linear this LoraConfig targets."""
    peft_config._register_custom_module({torch.nn.Linear: FusedLoraLinear})
