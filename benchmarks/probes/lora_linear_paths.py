"""The fused LoRA linear's paths against PEFT's, one layer at a time: forward + backward of every linear of a
qwen2.5-1.5b decoder layer (q, k, v, o, gate, up, down) with a rank-r adapter, per path:
- peft:   PEFT's own LoRA Linear;
- addmm:  train_loops.lora_linear.FusedLoraLinear with merging off (rank 1: the `_Rank1Lora` function);
- merged: the same with the adapter merged into the call's weight (`_MergedLora`, the default for calls
          with at least as many rows as inputs).
On a GPU the times come from CUDA events after warm-up; on CPU from perf_counter (fewer tokens by default).

    python -m benchmarks.probes.lora_linear_paths OUT.json [--tokens N] [--rank R] [--reps K]
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

# (name, in, out) of one qwen2.5-1.5b decoder layer's linears
SHAPES = [("q", 1536, 1536), ("k", 1536, 256), ("v", 1536, 256), ("o", 1536, 1536),
          ("gate", 1536, 8960), ("up", 1536, 8960), ("down", 8960, 1536)]


def layer(d_in: int, d_out: int, rank: int, fused: bool, dtype, device):
    from peft import LoraConfig, get_peft_model

    from train_loops import lora_linear

    base = torch.nn.Sequential(torch.nn.Linear(d_in, d_out, bias=False))
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["0"], init_lora_weights=False)
    if fused:
        lora_linear.register(cfg)
    return get_peft_model(copy.deepcopy(base), cfg).to(device=device, dtype=dtype)


def time_path(m, x, reps: int) -> float:
    """Seconds per forward + backward (the input needs its gradient, as inside a model)."""
    cuda = x.is_cuda

    def once():
        y = m(x)
        y.backward(torch.ones_like(y))

    for _ in range(2):
        once()
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            once()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        once()
    return (time.perf_counter() - t0) / reps


def main() -> int:
    from train_loops import lora_linear

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    cuda = torch.cuda.is_available()
    p.add_argument("--tokens", type=int, default=16384 if cuda else 2048)
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--reps", type=int, default=10 if cuda else 2)
    a = p.parse_args()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    rows, totals = [], {"peft": 0.0, "addmm": 0.0, "merged": 0.0}
    for name, d_in, d_out in SHAPES:
        x = torch.randn(a.tokens, d_in, device=device, dtype=dtype, requires_grad=True)
        row = {"linear": name, "in": d_in, "out": d_out}
        for path in totals:
            lora_linear.MERGE_MIN_ROWS_PER_INPUT = 0.0 if path == "merged" else float("inf")
            m = layer(d_in, d_out, a.rank, path != "peft", dtype, device)
            row[f"{path}_ms"] = time_path(m, x, a.reps) * 1e3
            totals[path] += row[f"{path}_ms"]
        lora_linear.MERGE_MIN_ROWS_PER_INPUT = 1.0
        rows.append(row)
        print(f"{name:>5} {d_in:>5}x{d_out:<5} " + "  ".join(f"{k} {row[k + '_ms']:8.2f} ms" for k in totals),
              flush=True)
    doc = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "dtype": str(dtype), "tokens": a.tokens,
           "rank": a.rank, "reps": a.reps, "command": "python -m benchmarks.probes.lora_linear_paths " +
           " ".join(sys.argv[1:]), "rows": rows, "layer_ms": totals,
           "merged_vs_addmm": totals["addmm"] / totals["merged"], "merged_vs_peft": totals["peft"] / totals["merged"]}
    print(f"layer: peft {totals['peft']:.1f} ms, addmm {totals['addmm']:.1f} ms, merged {totals['merged']:.1f} ms: "
          f"merged {doc['merged_vs_addmm']:.2f}x addmm, {doc['merged_vs_peft']:.2f}x peft", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
