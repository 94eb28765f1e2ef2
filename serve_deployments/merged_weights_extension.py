"""Merge mode: full (merged) base weights pushed into a running engine.

`MergedWeightsExtension` is mixed into vLLM's worker (`worker_extension_cls`), so
`AsyncLLM.collective_rpc("load_merged_weights", args=(path,))` runs it next to the model on every
worker. Tensors travel as a safetensors file on tmpfs, not through the RPC pickles: one copy, and
workers of a tensor-parallel engine each read the file themselves.

An engine with LoRA enabled wraps every LoRA-capable linear layer (`BaseLayerWithLoRA`), so its
parameters are named `...down_proj.base_layer.weight`. vLLM 0.32 (both builds now) resolves checkpoint names
through the wrappers; vLLM 0.25.1 (the earlier GPU build) did not and refused `...down_proj.weight`. The load
therefore runs with the wrappers taken out of the module tree (`lora_unwrapped`) and put back afterwards: the
weights are copied in place into the same base layers the wrappers hold, whichever vLLM runs.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.nn as nn


def _lora_wrapper_type() -> type | None:
    try:
        from vllm.lora.layers import BaseLayerWithLoRA
    except ImportError:  # a vLLM without LoRA layers has nothing to unwrap
        return None
    return BaseLayerWithLoRA


@contextmanager
def lora_unwrapped(model: nn.Module, wrapper_type: type | None = None) -> Iterator[int]:
    """Inside the block every LoRA wrapper of `model` is replaced by its `base_layer`, so checkpoint (HF)
    names resolve as in an engine without LoRA; yields how many were replaced. Restored on exit, also on
    error."""
    wrapper_type = wrapper_type or _lora_wrapper_type()
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    if wrapper_type is not None:
        for parent in list(model.modules()):
            for child_name, child in list(parent.named_children()):
                if isinstance(child, wrapper_type):
                    swapped.append((parent, child_name, child))
    try:
        for parent, child_name, wrapper in swapped:
            parent._modules[child_name] = wrapper.base_layer
        yield len(swapped)
    finally:
        for parent, child_name, wrapper in swapped:
            parent._modules[child_name] = wrapper


class MergedWeightsExtension:
    def load_merged_weights(self, path: str) -> dict:
        """Reload HF-named weights from a safetensors file in place.

        Goes through vLLM's own `reload_weights` (layerwise reload): the CPU backend repacks linear
        weights after loading and leaves empty checkpoint-format parameters behind, so a plain
        `model.load_weights` cannot write into them. It also resets the runner's LoRA state.
        Returns how many tensors were loaded and how many LoRA wrappers were stepped around."""
        from safetensors.torch import load_file

        tensors = load_file(path)
        with lora_unwrapped(self.model_runner.get_model()) as wrappers:
            self.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        return {"tensors": len(tensors), "lora_wrappers": wrappers}
