"""Liger's fused Triton kernels (RMSNorm, RoPE, SwiGLU) in the trainer's decoder, on GPU.

A LoRA step on a 1.5B body spends about half its GPU time in elementwise kernels around the GEMMs
(norms with their float32 round trips, rotary embeddings, the gated MLP's activation); Liger fuses each
into one kernel forward and one backward. Liger patches the model instance by its `model_type`; the
loss is ours (train_loops/head_logprobs.py), so its cross-entropy patches stay off: they could not apply
`grpo.top_p`'s nucleus, which head_logprobs does with or without Liger. Triton has no CPU backend here:
on CPU nothing is patched.

`train.liger_kernels`: auto = on GPU when `liger_kernel` is installed (`.[gpu]`), on = required, off.
"""
from __future__ import annotations

from common.config import LIGER_ON_NEEDS_GPU, Config, ConfigError


def apply_liger(model, cfg: Config, on_gpu: bool) -> str:
    """Patch `model` (a HF causal LM, before PEFT wraps it) in place; returns what was done, for the log
    and the metrics ("liger: ..." or why not)."""
    mode = cfg.train.liger_kernels
    if mode == "off":
        return "off"
    if not on_gpu:
        if mode == "on":
            raise ConfigError([LIGER_ON_NEEDS_GPU])
        return "off (CPU)"
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN, _apply_liger_kernel_to_instance
    except ImportError as e:
        if mode == "on":
            raise ConfigError([f"train.liger_kernels: on, but liger_kernel does not import ({e}); "
                               "pip install -e '.[gpu]'"]) from e
        return "off (liger_kernel not installed)"
    model_type = getattr(model.config, "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        if mode == "on":
            raise ConfigError([f"train.liger_kernels: on, but Liger has no kernels for model type {model_type!r}"])
        return f"off (no Liger kernels for {model_type})"
    _apply_liger_kernel_to_instance(model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)
    return f"on ({model_type}: rms_norm, rope, swiglu)"


def liger_applied(status: str) -> bool:
    """Whether apply_liger's status line says the kernels are in the model (the memory estimate differs)."""
    return status.startswith("on")
