"""benchmarks/gpu_pipeline.py's trainer phase: our trainer (train_loops.harness under torchrun) against a plain
PEFT loop on the same tokens, with the step's model FLOPs for the MFU."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks._gpu_pipeline_common import PEAK_BF16_FLOPS, REPO, SCRIPT, WORKLOAD, _env
from common.ports import free_port
from common.stats import p50


def model_flops_per_step(model: Path, seqs: int, seq_len: int, completion_len: int) -> float:
    """Model FLOPs of one LoRA training step (no recompute counted): forward 2N + input-gradient backward
    2N per token through the decoder for every token, and through the LM head for completion tokens
    only (what the loss reads); the adapter's own FLOPs are negligible at rank 1."""
    import json as _json

    c = _json.loads((model / "config.json").read_text())
    h, i, layers, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    kv = c["num_key_value_heads"] * (h // c["num_attention_heads"])
    body = layers * (2 * h * h + 2 * h * kv + 3 * h * i)
    attn = layers * 2 * seq_len * h  # causal QK^T and AV, averaged over positions
    return 4.0 * seqs * (seq_len * (body + attn) + completion_len * h * v)



def _run_trainer(args, work: Path, model: Path, sets: list[str], profile: bool) -> tuple[dict, Path]:
    """One torchrun of train_loops.harness on the synthetic workload; returns its numbers."""
    import torch

    w = WORKLOAD
    gpu = torch.cuda.is_available()
    dump = work / "dump"
    config = {
        "model": {"path": str(model), "build_tiny": False, "dtype": w["dtype"] if gpu else "float32",
                  "max_model_len": 2048},
        "lora": {"rank": w["lora_rank"], "alpha": 2.0 * w["lora_rank"], "target_modules": w["target_modules"]},
        "grpo": {"group_size": w["group_size"], "prompts_per_step": w["prompts_per_step"],
                 "max_new_tokens": w["new_tokens"], "lr": 1e-4},
        "train": {"num_workers": 1, "use_gpu": gpu, "zero_stage": 2, "total_steps": args.trainer_steps,
                  "profile_step": args.trainer_steps - 1 if profile else None},
        "rollout": {"max_lora_rank": w["lora_rank"]},
        "checkpoint": {"every": 0},
        "run": {"out_dir": str(work), "name": dump.name},  # RUN_DIR (profile.txt) is the dump directory
    }
    from common.config import apply_overrides

    apply_overrides(config, sets)  # the CLI's own --set (from_dict turns YAML's on/off back into words)
    from train_loops.harness import HarnessOptions
    from train_loops.worker import loop_config

    options = HarnessOptions(checkpoint_dir=str(work / "ck"),
                            record_dir=str(dump), synthetic_prompt_len=w["prompt_tokens"],
                            synthetic_completion_len=w["new_tokens"])
    work.mkdir(parents=True, exist_ok=True)
    (work / "loop.json").write_text(json.dumps(loop_config(config, options)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", f"--master_port={free_port()}",
           "-m", "train_loops.harness", str(work / "loop.json")]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True)
    res: dict = {"trainer_wall_s": time.time() - t0, "trainer_sets": sets}
    (work / "trainer.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        res["trainer_error"] = proc.stderr[-2000:]
        return res, dump
    rows = [json.loads(x) for x in (dump / "steps.jsonl").read_text().splitlines()]
    steady = [r for r in rows[1:] if r["step"] != config["train"]["profile_step"]] or rows
    res.update({"trainer_tokens_per_s": p50([r["train_tokens_per_s"] for r in steady]),
                "trainer_learn_s_p50": p50([r["learn_seconds"] for r in steady]),
                "trainer_micro_batches": rows[-1].get("micro_batches"),
                "trainer_peak_mem_gib": max(r.get("peak_mem_gib", 0.0) for r in rows)})
    if (dump / "trainer_info.json").exists():
        res["trainer_info"] = json.loads((dump / "trainer_info.json").read_text())
    return res, dump


def phase_trainer(args, work: Path, model: Path, out: Path) -> dict:
    w = WORKLOAD
    seqs = w["prompts_per_step"] * w["group_size"]
    seq_len = w["prompt_tokens"] + w["new_tokens"]
    res, dump = _run_trainer(args, work / "trainer", model, list(args.trainer_set), profile=True)
    if res.get("trainer_error"):
        (out / "gpu_pipeline_trainer.log").write_text((work / "trainer" / "trainer.log").read_text())
    if (dump / "profile.txt").exists():
        (out / "gpu_pipeline_profile.txt").write_text((dump / "profile.txt").read_text())
    # Ablations: the same trainer with one setting changed each, tokens/s in the same session.
    ablation = {}
    for i, variant in enumerate(x for x in args.trainer_ablation.split(";") if x):
        r, _ = _run_trainer(args, work / f"ablation-{i}", model, list(args.trainer_set) + variant.split(","),
                            profile=False)
        ablation[variant] = {k: r.get(k) for k in ("trainer_tokens_per_s", "trainer_learn_s_p50",
                                                   "trainer_peak_mem_gib", "trainer_info", "trainer_error")}
    if ablation:
        res["trainer_ablation"] = ablation
    cmd = [sys.executable, str(SCRIPT), "_peft", "--model", str(model), "--steps", str(args.trainer_steps),
           "--out", str(work / "peft.json")]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        (out / "gpu_pipeline_peft.log").write_text(proc.stdout + proc.stderr)
        res["peft_error"] = proc.stderr[-2000:]
    else:
        res.update(json.loads((work / "peft.json").read_text()))
    flops = model_flops_per_step(model, seqs, seq_len, w["new_tokens"])
    if res.get("trainer_tokens_per_s"):
        res["trainer_mfu"] = flops / (seqs * seq_len) * res["trainer_tokens_per_s"] / PEAK_BF16_FLOPS
    if res.get("trainer_tokens_per_s") and res.get("peft_tokens_per_s"):
        res["trainer_vs_peft"] = res["trainer_tokens_per_s"] / res["peft_tokens_per_s"]
    return res


def peft_loop(model: str, steps: int, micro: int, checkpointing: bool = True) -> dict:
    """The plain loop: HF model + PEFT LoRA (rank 1, all-linear), sdpa, full logits, float32 log-softmax,
    a GRPO-shaped loss on the completion tokens, AdamW; 128 sequences per optimizer step in micro-batches
    of `micro`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    w = WORKLOAD
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16, attn_implementation="sdpa").to(dev)
    if checkpointing:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.enable_input_require_grads()
    m = get_peft_model(m, LoraConfig(r=w["lora_rank"], lora_alpha=2 * w["lora_rank"],
                                     target_modules=w["target_modules"], lora_dropout=0.0))
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
    seqs, p, c = w["prompts_per_step"] * w["group_size"], w["prompt_tokens"], w["new_tokens"]
    g = torch.Generator().manual_seed(0)
    vocab = m.config.vocab_size
    times = []
    for _ in range(steps):
        ids = torch.randint(3, vocab, (seqs, p + c), generator=g).to(dev)
        adv = torch.randn(seqs, generator=g).to(dev)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(0, seqs, micro):
            x = ids[i:i + micro]
            logits = m(input_ids=x).logits[:, p - 1:-1]
            logp = torch.log_softmax(logits.float(), -1).gather(-1, x[:, p:, None]).squeeze(-1)
            loss = -(logp * adv[i:i + micro, None]).sum() / (seqs * c)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    steady = times[1:] or times
    t = p50(steady)
    return {"peft_tokens_per_s": seqs * (p + c) / t, "peft_step_s_p50": t, "peft_micro_batch": micro,
            "peft_gradient_checkpointing": checkpointing,
            "peft_peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None}

