"""Probe (CPU or GPU host): the CPU steps of a replica's adapter load for the 1.5B shape's rank-1 all-linear
adapter (392 tensors, 2.3 MB): unpack the fetched buffer, verify (digest and shapes), and write the adapter
file, by serializing the tensors again against writing the fetched bytes; the trainer's pack beside them.
Median of 7; writes OUT_JSON.
    python -m benchmarks.probes.replica_load_steps [OUT_JSON]"""
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from common.adapter_io import make_meta, pack_tensors, unpack_tensors, write_peft_dir
from serve_deployments.adapter_files import BaseModelShapes, verify_adapter

# Qwen2.5-1.5B: the 7 linears of each of 28 layers, (in, out, block).
LINEARS = {"q_proj": (1536, 1536, "self_attn"), "k_proj": (1536, 256, "self_attn"),
           "v_proj": (1536, 256, "self_attn"), "o_proj": (1536, 1536, "self_attn"),
           "gate_proj": (1536, 8960, "mlp"), "up_proj": (1536, 8960, "mlp"), "down_proj": (8960, 1536, "mlp")}


def main(out: str | None) -> dict:
    from transformers import Qwen2Config

    work = Path(tempfile.mkdtemp(prefix="load-steps-"))
    Qwen2Config(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True).save_pretrained(work / "model")
    shapes = BaseModelShapes(str(work / "model"))
    tensors = {}
    for layer in range(28):
        for mod, (fan_in, fan_out, block) in LINEARS.items():
            base = f"base_model.model.model.layers.{layer}.{block}.{mod}"
            tensors[f"{base}.lora_A.weight"] = torch.randn(1, fan_in, dtype=torch.bfloat16)
            tensors[f"{base}.lora_B.weight"] = torch.randn(fan_out, 1, dtype=torch.bfloat16)
    peft = {"r": 1, "lora_alpha": 2, "target_modules": sorted(LINEARS), "peft_type": "LORA"}
    meta = make_meta(tensors, peft)
    packed = pack_tensors(tensors)
    steps = {"trainer_pack": lambda: pack_tensors(tensors), "unpack": lambda: unpack_tensors(packed),
             "verify": lambda: verify_adapter(tensors, meta, shapes, 8),
             "write_serialized": lambda: write_peft_dir(tensors, peft, work / "a"),
             "write_fetched_bytes": lambda: write_peft_dir(tensors, peft, work / "b", packed)}
    res = {"tensors": len(tensors), "mbytes": len(packed) / 1e6}
    for name, fn in steps.items():
        xs = []
        for _ in range(7):
            t0 = time.perf_counter()
            fn()
            xs.append(time.perf_counter() - t0)
        res[f"{name}_ms_p50"] = 1000 * statistics.median(xs)
    assert unpack_tensors((work / "b" / "adapter_model.safetensors").read_bytes()).keys() == tensors.keys()
    print(json.dumps(res), flush=True)
    if out:
        Path(out).write_text(json.dumps({**res, "command": "python -m benchmarks.probes.replica_load_steps " + out,
                                         "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=1))
    return res


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out_json", nargs="?", help="where the result goes (default: printed only)")
    main(ap.parse_args().out_json)
