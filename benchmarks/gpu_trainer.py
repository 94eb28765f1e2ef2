"""GPU check of the training side (no Ray, no vLLM needed): train_loops.harness under torchrun with
nccl, bf16, DeepSpeed ZeRO-2/3 over N GPUs, synthetic GRPO batches, on a model shaped like the
Qwen2.5-1.5B body (hidden 1536, 28 layers, 12/2 heads, intermediate 8960; the tiny character
vocabulary instead of 151,936 tokens) or on the tiny model.

    python -m benchmarks.gpu_trainer --nproc 2 --shape qwen1.5b-body --out benchmarks/results

Writes gpu_trainer.json: step seconds, trainer tokens/s and peak GPU memory per ZeRO stage."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common.ports import free_port

REPO = Path(__file__).resolve().parents[1]

SHAPES = {
    "tiny": {},
    "qwen1.5b-body": {"hidden": 1536, "layers": 28, "heads": 12, "kv_heads": 2, "intermediate": 8960,
                      "pretrain_steps": 0},
}



def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--shape", choices=list(SHAPES), default="qwen1.5b-body")
    p.add_argument("--zero", type=int, nargs="+", default=[2], help="ZeRO stages (3 is refused on GPU for LoRA)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--new-tokens", type=int, default=1024)
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args(argv)

    from app.tiny_model import build_tiny_model
    from train_loops.harness import HarnessOptions
    from train_loops.worker import loop_config

    work = Path(tempfile.mkdtemp(prefix="gpu-trainer-"))
    t0 = time.time()
    model = build_tiny_model(work / "model", seed=0, **SHAPES[args.shape])
    print(f"model {args.shape} built in {time.time() - t0:.0f}s", flush=True)
    results = []
    for zero in args.zero:
        dump = work / f"z{zero}"
        config = {
            "model": {"path": str(model), "build_tiny": False, "dtype": "bfloat16", "max_model_len": 2048},
            "lora": {"rank": args.rank, "alpha": 2.0 * args.rank, "target_modules": "all-linear"},
            "grpo": {"group_size": 8, "prompts_per_step": 2 * args.nproc, "max_new_tokens": args.new_tokens,
                     "lr": 1e-4},
            "train": {"num_workers": args.nproc, "use_gpu": True, "zero_stage": zero, "total_steps": args.steps,
                      "gradient_checkpointing": True, "logprob_chunk": 2048},
            "rollout": {"max_lora_rank": max(8, args.rank) if args.rank > 1 else 1},
            "checkpoint": {"every": 0},
        }
        options = HarnessOptions(checkpoint_dir=str(work / f"ck{zero}"),
                                record_dir=str(dump))
        cfg_file = work / f"loop_z{zero}.json"
        cfg_file.write_text(json.dumps(loop_config(config, options)))
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
               f"--master_port={free_port()}", "-m", "train_loops.harness", str(cfg_file)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                   TOKENIZERS_PARALLELISM="false")
        t1 = time.time()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        wall = time.time() - t1
        if proc.returncode != 0:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / f"gpu_trainer_z{zero}.log").write_text(proc.stdout + proc.stderr)
            results.append({"zero": zero, "ok": False, "error": proc.stderr[-2000:]})
            continue
        rows = [json.loads(line) for line in (dump / "steps.jsonl").read_text().splitlines()]
        steady = rows[1:] or rows
        res = {"zero": zero, "ok": True, "nproc": args.nproc, "wall_seconds": wall,
               "step_seconds_p50": sorted(r["step_seconds"] for r in steady)[len(steady) // 2],
               "train_tokens_per_s_p50": sorted(r["train_tokens_per_s"] for r in steady)[len(steady) // 2],
               "tokens_per_step": rows[-1].get("seq_tokens"), "loss_last": rows[-1].get("loss"),
               "peak_mem_gib": max(r.get("peak_mem_gib", 0.0) for r in rows),
               "adapter_bytes": rows[-1].get("adapter_bytes")}
        results.append(res)
        print(json.dumps(res), flush=True)
    import torch

    doc = {"shape": args.shape, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "args": vars(args), "results": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_trainer.json").write_text(json.dumps(doc, indent=2))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
