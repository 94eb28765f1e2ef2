"""Registry payload -> verified PEFT directory on node-local tmpfs (the form vLLM loads LoRA from).

Shapes are checked against the base model before vLLM sees the files: a bad path or tensor inside
`generate()` kills the engine, inside `add_lora` it only raises, and here it is a clear AdapterError.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from common.adapter_io import AdapterError, verify_payload, write_peft_dir

_LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


def scratch_root(tag: str) -> Path:
    """A per-process directory on tmpfs (/dev/shm) when there is one, else the temp dir.

    Named with the owner's pid: a replica that is killed never cleans up, so each new one removes
    the directories of owners that no longer exist (tmpfs is RAM)."""
    base = Path("/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir())
    for old in base.glob("lora-grpo-*-pid*-*"):
        pid = re.search(r"-pid(\d+)-", old.name)
        if pid and not _alive(int(pid.group(1))):
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"lora-grpo-{tag}-pid{os.getpid()}-", dir=base))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: existence check only
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class BaseModelShapes:
    """Weight shapes of the base model, from its config alone (meta tensors: no weights read)."""

    def __init__(self, model_path: str):
        import torch  # here: the ingress imports this module and never needs torch
        from transformers import AutoConfig, AutoModelForCausalLM

        hf_cfg = AutoConfig.from_pretrained(model_path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_cfg)
        self.linear = {n: (m.in_features, m.out_features) for n, m in model.named_modules()
                       if isinstance(m, torch.nn.Linear)}
        self.params = {n: tuple(t.shape) for n, t in model.state_dict().items()}
        # Tied output embeddings: the checkpoint may or may not carry lm_head.weight.
        self.optional = {"lm_head.weight"} if getattr(hf_cfg, "tie_word_embeddings", False) else set()

    def lora_shapes(self, names, peft_config: dict, max_rank: int) -> dict[str, tuple[int, ...]]:
        """Expected shape of each PEFT LoRA tensor name: A is (r, in), B is (out, r)."""
        r_default = int(peft_config.get("r", 0))
        pattern = peft_config.get("rank_pattern") or {}
        out = {}
        for name in names:
            m = _LORA_KEY.match(name)
            if not m or m.group("module") not in self.linear:
                continue  # verify_payload names it as pairing with no module
            module = m.group("module")
            r = next((int(v) for k, v in pattern.items() if module.endswith(k)), r_default)
            if r > max_rank:
                raise AdapterError(f"adapter rank {r} on {module} exceeds the engine's max_lora_rank {max_rank}")
            fan_in, fan_out = self.linear[module]
            out[name] = (r, fan_in) if m.group("ab") == "A" else (fan_out, r)
        return out


def verify_adapter(tensors: dict, meta: dict, shapes: BaseModelShapes, max_rank: int) -> None:
    if meta.get("kind", "adapter") != "adapter":
        raise AdapterError(
            f"payload kind {meta.get('kind')!r} is not a LoRA adapter (merged weights go to update_weights)"
        )
    peft_config = meta.get("peft_config") or {}
    if peft_config.get("use_dora"):
        raise AdapterError("DoRA adapters cannot be served as LoRA; use sync.mode=merge")
    if peft_config.get("modules_to_save"):
        raise AdapterError("modules_to_save cannot be served as LoRA; use sync.mode=merge")
    verify_payload(tensors, meta, shapes.lora_shapes(tensors, peft_config, max_rank))


def verify_merged(tensors: dict, meta: dict, shapes: BaseModelShapes) -> None:
    if meta.get("kind") != "merged":
        raise AdapterError(f"payload kind {meta.get('kind')!r} is not merged weights")
    verify_payload(tensors, meta, shapes.params)
    # vLLM reloads layer by layer and finalizes a layer once its weights are in: a partial payload
    # would leave layers half old, half new.
    missing = sorted(set(shapes.params) - set(tensors) - shapes.optional)
    if missing:
        raise AdapterError(f"merged weights lack {len(missing)} base tensors, e.g. {missing[:3]}")


def write_adapter_dir(tensors: dict, meta: dict, root: Path, name: str, packed: bytes | None = None) -> Path:
    return write_peft_dir(tensors, meta["peft_config"], root / name, packed)


def remove_dir(path: str | Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
