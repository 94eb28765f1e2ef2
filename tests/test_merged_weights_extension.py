"""Merge mode's weight load around vLLM's LoRA wrappers (serve_deployments/merged_weights_extension.py).

vLLM 0.25.1 (the earlier GPU build) with LoRA enabled names a wrapped layer's weight
`...down_proj.base_layer.weight` and its loader refuses the checkpoint name `...down_proj.weight`; vLLM 0.32
resolves the name through the wrapper, so a real engine of this release cannot show the failure. This test
rebuilds the 0.25.1 situation with vLLM's real `BaseLayerWithLoRA` class and a loader that resolves names
strictly, as 0.25.1's does; the real-engine side (the CPU engine does wrap its layers, and a merged load goes
around them) is in tests/test_replica.py::test_merge_mode_update_weights.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from vllm.lora.layers import BaseLayerWithLoRA

from serve_deployments.merged_weights_extension import lora_unwrapped


class _Wrapped(BaseLayerWithLoRA):
    """A LoRA wrapper as vLLM builds one: the original layer under `base_layer`."""

    def __init__(self, base: nn.Module):
        nn.Module.__init__(self)
        self.base_layer = base


def _model() -> nn.Module:
    mlp = nn.Module()
    mlp.down_proj = nn.Linear(4, 4, bias=False)
    mlp.up_proj = nn.Linear(4, 4, bias=False)
    layer = nn.Module()
    layer.mlp = mlp
    model = nn.Module()
    model.layers = nn.ModuleList([layer])
    model.norm = nn.LayerNorm(4)
    mlp.down_proj = _Wrapped(mlp.down_proj)
    mlp.up_proj = _Wrapped(mlp.up_proj)
    return model


def _strict_load(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Resolve every checkpoint name to a module and parameter, refusing what is not there."""
    for name, tensor in weights.items():
        module_name, _, param_name = name.rpartition(".")
        module = model.get_submodule(module_name)
        if param_name not in module._parameters:
            raise ValueError(f"There is no module or parameter named {name!r}")
        with torch.no_grad():
            module._parameters[param_name].copy_(tensor)


def test_wrapped_names_are_refused_without_unwrapping():
    model = _model()
    assert "layers.0.mlp.down_proj.base_layer.weight" in dict(model.named_parameters())
    with pytest.raises(ValueError, match="down_proj.weight"):
        _strict_load(model, {"layers.0.mlp.down_proj.weight": torch.ones(4, 4)})


def test_merged_weights_load_around_the_wrappers_and_wrappers_come_back():
    model = _model()
    wrapper = model.layers[0].mlp.down_proj
    base_weight = wrapper.base_layer.weight
    new = {"layers.0.mlp.down_proj.weight": torch.full((4, 4), 2.0),
           "layers.0.mlp.up_proj.weight": torch.full((4, 4), 3.0), "norm.weight": torch.full((4,), 5.0)}
    with lora_unwrapped(model) as count:
        assert count == 2
        _strict_load(model, new)
    assert model.layers[0].mlp.down_proj is wrapper  # the wrapper is back in the tree
    assert wrapper.base_layer.weight is base_weight  # loaded in place: the same parameter the wrapper holds
    assert torch.equal(wrapper.base_layer.weight, new["layers.0.mlp.down_proj.weight"])
    assert torch.equal(model.layers[0].mlp.up_proj.base_layer.weight, new["layers.0.mlp.up_proj.weight"])
    assert torch.equal(model.norm.weight, new["norm.weight"])


def test_wrappers_come_back_when_the_load_fails():
    model = _model()
    wrapper = model.layers[0].mlp.down_proj
    with pytest.raises(ValueError), lora_unwrapped(model):
        _strict_load(model, {"layers.0.mlp.down_proj.scale": torch.ones(4)})
    assert model.layers[0].mlp.down_proj is wrapper


def test_a_model_without_lora_is_left_alone():
    model = nn.Sequential(nn.Linear(2, 2))
    with lora_unwrapped(model) as count:
        assert count == 0
    assert isinstance(model[0], nn.Linear)
