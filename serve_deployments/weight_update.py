"""Merge mode: full (merged) base weights pushed into a running engine.

`MergedWeightsExtension` is mixed into vLLM's worker (`worker_extension_cls`), so
`AsyncLLM.collective_rpc("load_merged_weights", args=(path,))` runs it next to the model on every
worker. Tensors travel as a safetensors file on tmpfs, not through the RPC pickles: one copy, and
workers of a tensor-parallel engine each read the file themselves.
"""
from __future__ import annotations


class MergedWeightsExtension:
    def load_merged_weights(self, path: str) -> int:
        """Reload HF-named weights from a safetensors file in place.

        Goes through vLLM's own `reload_weights` (layerwise reload): the CPU backend repacks linear
        weights after loading and leaves empty checkpoint-format parameters behind, so a plain
        `model.load_weights` cannot write into them. It also resets the runner's LoRA state."""
        from safetensors.torch import load_file

        tensors = load_file(path)
        self.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        return len(tensors)
