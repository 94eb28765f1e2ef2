"""Fold a PEFT LoRA adapter into its base model and write a standalone HF checkpoint.

Streams shard by shard (model.safetensors, or the shards of model.safetensors.index.json): memory is
bounded by the largest shard plus the adapter. Every adapter tensor must pair with a base tensor; one
that does not is an error naming it (a silent skip would serve the base model under a policy name).

CLI: `python -m train_loops.merge --base DIR --adapter DIR --out DIR` (the driver exposes it as
`python -m app merge ...` through `main(argv)`)."""
from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
from pathlib import Path

import torch

from common.adapter_io import AdapterError, read_peft_dir

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
PEFT_PREFIX = "base_model.model."
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")
# Everything except weights and their index is copied as is (config, tokenizer, generation config...).
_SKIP_COPY = re.compile(r"(\.safetensors|\.bin|\.pt|\.pth|\.index\.json)$")


def _scaling(peft_cfg: dict, module: str) -> tuple[float, int]:
    from peft.utils.other import get_pattern_key

    r, alpha = peft_cfg["r"], peft_cfg["lora_alpha"]
    rank_pattern, alpha_pattern = peft_cfg.get("rank_pattern") or {}, peft_cfg.get("alpha_pattern") or {}
    if rank_pattern:
        key = get_pattern_key(rank_pattern.keys(), module)
        r = rank_pattern.get(key, r)
    if alpha_pattern:
        key = get_pattern_key(alpha_pattern.keys(), module)
        alpha = alpha_pattern.get(key, alpha)
    return (alpha / math.sqrt(r) if peft_cfg.get("use_rslora") else alpha / r), r


def lora_pairs(adapter: dict[str, torch.Tensor], peft_cfg: dict) -> dict[str, tuple]:
    """Adapter tensors -> {base weight name: (A, B, scaling)}; raises AdapterError on anything that is
    not a LoRA A/B weight or on an A without its B."""
    if peft_cfg.get("use_dora"):
        raise AdapterError("DoRA adapters are not supported by the merge tool")
    fan_in_fan_out = bool(peft_cfg.get("fan_in_fan_out"))
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in adapter.items():
        m = _LORA_KEY.match(name)
        if not m or not name.startswith(PEFT_PREFIX):
            raise AdapterError(f"adapter tensor {name!r} is not a LoRA A/B weight this tool can merge")
        parts.setdefault(m["module"][len(PEFT_PREFIX):], {})[m["which"]] = t
    pairs = {}
    for module, ab in parts.items():
        if set(ab) != {"A", "B"}:
            missing = "B" if "A" in ab else "A"
            raise AdapterError(f"adapter module {module!r} has no lora_{missing} tensor")
        scaling, _ = _scaling(peft_cfg, module)
        pairs[f"{module}.weight"] = (ab["A"], ab["B"], scaling, fan_in_fan_out)
    return pairs


def fold(weight: torch.Tensor, pair: tuple) -> torch.Tensor:
    """W + scaling * B @ A, computed in float32 and cast back to W's dtype."""
    a, b, scaling, fan_in_fan_out = pair
    delta = (b.float() @ a.float()) * scaling
    if fan_in_fan_out:
        delta = delta.T
    if delta.shape != weight.shape:
        raise AdapterError(f"LoRA delta shape {tuple(delta.shape)} does not match base weight {tuple(weight.shape)}")
    return (weight.float() + delta).to(weight.dtype)


def merged_state(base: dict[str, torch.Tensor], pairs: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """In-memory merge (the trainer's merge-mode publish): every base tensor, the paired ones folded."""
    unpaired = sorted(set(pairs) - set(base))
    if unpaired:
        raise AdapterError(f"adapter weight(s) pair with no base tensor: {unpaired[:5]}")
    return {k: fold(v, pairs[k]) if k in pairs else v for k, v in base.items()}


def shard_files(base_dir: Path) -> list[str]:
    if (base_dir / INDEX).is_file():
        return sorted(set(json.loads((base_dir / INDEX).read_text())["weight_map"].values()))
    if (base_dir / SINGLE).is_file():
        return [SINGLE]
    raise FileNotFoundError(f"{base_dir}: neither {SINGLE} nor {INDEX} (only safetensors checkpoints merge)")


def load_base_state(base_dir: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    base_dir = Path(base_dir)
    out = {}
    for f in shard_files(base_dir):
        out.update(load_file(str(base_dir / f)))
    return out


def merge_adapter(base_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path) -> Path:
    from safetensors import safe_open
    from safetensors.torch import save_file

    base_dir, out_dir = Path(base_dir), Path(out_dir)
    tensors, peft_cfg = read_peft_dir(adapter_dir)
    pairs = lora_pairs(tensors, peft_cfg)
    files = shard_files(base_dir)
    names_by_file = {}
    for f in files:  # check pairing before writing anything
        with safe_open(str(base_dir / f), framework="pt") as sf:
            names_by_file[f] = list(sf.keys())
    all_names = {n for ns in names_by_file.values() for n in ns}
    for name in sorted(pairs):
        if name not in all_names:
            module = name[:-len(".weight")]
            raise AdapterError(f"adapter tensor {PEFT_PREFIX}{module}.lora_A.weight pairs with no base tensor "
                               f"(looked for {name!r} in {base_dir})")
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in files:
        with safe_open(str(base_dir / f), framework="pt") as sf:
            meta = sf.metadata() or {"format": "pt"}
            shard = {n: sf.get_tensor(n) for n in names_by_file[f]}
        for n in shard:
            if n in pairs:
                shard[n] = fold(shard[n], pairs[n])
        save_file(shard, str(out_dir / f), metadata=meta)
        del shard
    for p in base_dir.iterdir():
        if p.is_file() and (not _SKIP_COPY.search(p.name) or p.name == INDEX):
            shutil.copy2(p, out_dir / p.name)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="merge", description="Fold a PEFT LoRA adapter into its base model.")
    ap.add_argument("--base", required=True, help="HF model directory (safetensors).")
    ap.add_argument("--adapter", required=True, help="PEFT adapter directory (adapter_config.json + safetensors).")
    ap.add_argument("--out", required=True, help="Output directory for the standalone merged model.")
    args = ap.parse_args(argv)
    try:
        out = merge_adapter(args.base, args.adapter, args.out)
    except (AdapterError, FileNotFoundError) as e:
        print(f"merge failed: {e}", file=sys.stderr)
        return 1
    print(f"merged {args.adapter} into {args.base} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
