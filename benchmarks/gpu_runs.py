"""The GPU runs, each a real `app train` run (driver, Ray, Serve, vLLM, DeepSpeed) on a local
Ray cluster limited to the run's GPU count:

    python -m benchmarks.gpu_runs small-1x   # recipes/gpu-1x.yaml: the small model learns on one GPU (z > 3)
    python -m benchmarks.gpu_runs small-2x   # recipes/gpu-2x.yaml on two GPUs
    python -m benchmarks.gpu_runs qwen-1x    # the Qwen2.5-1.5B shape (real vocabulary), 16 x 8, 1,024 new
    python -m benchmarks.gpu_runs qwen-2x    #   tokens, rank 1, 20 steps, default micro-batching
    python -m benchmarks.gpu_runs small-1x --merge   # the same with sync.mode=merge
    python -m benchmarks.gpu_runs small-multiturn-1x # the small model plays LetterHunt (two turns) on one GPU
    python -m benchmarks.gpu_runs small-judge-1x     # gpu-1x with a judge reward (its own base model as judge)
    python -m benchmarks.gpu_runs gemma-rgym-1x      # Gemma 3 270M on reasoning-gym chain_sum

Each run adds a record to OUT/gpu_runs.json (reward z-test, step-1 trainer/vLLM log ratio, step times,
micro-batches, peak memory, publish latency) with the command that made it. CPU smoke: `--smoke`
runs the tiny CPU recipe through the same code (what the tests do)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from common.stats import mean, p50

REPO = Path(__file__).resolve().parents[1]

QWEN = ["model.path=runs/qwen2.5-1.5b-model", "model.tiny_shape=qwen2.5-1.5b", "model.max_model_len=2048",
        "grpo.max_new_tokens=1024", "lora.rank=1", "lora.alpha=2", "rollout.max_lora_rank=1",
        "train.total_steps=20", "checkpoint.every=0", "grpo.lr=1e-4",
        # 128 x 1,024 tokens per step: CUDA graphs cut decode time several-fold (one 60-100 s compile),
        # and 48 groups in flight keep the engine's batch full ((max_staleness + 1) x 16 prompts).
        "rollout.enforce_eager=false", "rollout.groups_per_worker=12"]
# recipes/tiny-multiturn.yaml's task on the GPU recipe: episodes of up to two turns, rewards from the environment.
MULTITURN = ["data.path=builtin:letter-hunt", "env.cls=app.builtin_envs:LetterHunt", "env.max_turns=2",
             "reward.fn=null", "eval.path=builtin:letter-hunt-heldout", "eval.every=10", "eval.samples=128"]
# A judge reward on the GPU (issue 39): recipes/judge-cpu.yaml's judge on the GPU recipe, the run's own base model
# (adapter off) asked through the run's own replica; the judge metrics (judge_calls, judge_parse_failures, ...) are
# on the step rows.
JUDGE = ["reward.judge.template=Is the answer {answer}? The reply was: {completion}. Reply Y or N.",
         "reward.judge.parse={kind: words, yes: [Y, yes], no: [N, no]}", "reward.judge.weight=0.5",
         "reward.judge.max_tokens=2", "reward.judge.temperature=0.0", "reward.judge.timeout_s=30",
         "reward.judge.max_concurrency=64", "train.total_steps=30"]
RUNS = {
    "small-1x": ("recipes/gpu-1x.yaml", [], 1),
    "small-judge-1x": ("recipes/gpu-1x.yaml", JUDGE, 1),
    # reasoning-gym's chain_sum on Gemma 3 270M (issue 39); runs/gemma3-270m first: benchmarks.real_model --import-only
    "gemma-rgym-1x": ("recipes/gemma3-270m-reasoning-gym.yaml", [], 1),
    "small-multiturn-1x": ("recipes/gpu-1x.yaml", MULTITURN, 1),
    "small-2x": ("recipes/gpu-2x.yaml", [], 2),
    "qwen-1x": ("recipes/gpu-1x.yaml", QWEN, 1),
    "qwen-2x": ("recipes/gpu-2x.yaml", QWEN, 2),
    "smoke": ("recipes/tiny-cpu.yaml", ["train.total_steps=6", "checkpoint.every=0"], 0),
}


def _rate(rows: list[dict]) -> float | None:
    """Generated tokens per second over rows: each row's rate times its step's seconds, summed, / the seconds."""
    rows = [r for r in rows if r.get("gen_tokens_per_s") is not None and r.get("step_seconds")]
    secs = sum(r["step_seconds"] for r in rows)
    return sum(r["gen_tokens_per_s"] * r["step_seconds"] for r in rows) / secs if secs else None


def record(name: str, cfg, rows: list[dict], summary: dict, wall: float, command: str) -> dict:
    from common.stats import proportion_z

    steady = rows[2:] or rows
    k = max(1, len(rows) // 4)
    n = cfg.grpo.prompts_per_step * cfg.grpo.group_size
    return {
        "run": name, "command": command, "wall_seconds": wall, "steps": len(rows),
        "total_steps": cfg.train.total_steps, "ended_by": summary.get("ended_by"),  # train.max_minutes or steps
        # tiny_shape names the model only when this run built it; model.path otherwise (gpu_pipeline's runs).
        "model_shape": cfg.model.tiny_shape if cfg.model.build_tiny else None, "model_path": str(cfg.model.path),
        "sync_mode": cfg.sync.mode,
        "reward_first_quarter": summary.get("reward_first_quarter"),
        "reward_last_quarter": summary.get("reward_last_quarter"),
        "reward_z": proportion_z(rows[:k], rows[-k:], n) if len(rows) >= 4 else None,
        "step1_log_ratio_abs_mean": rows[0].get("log_ratio_abs_mean") if rows else None,
        "log_ratio_abs_mean_p50": p50([r.get("log_ratio_abs_mean") for r in rows]),
        # Over samples of the trainer's current version only: the engines' mismatch without policy drift.
        "log_ratio_fresh_p50": p50([r.get("log_ratio_fresh") for r in rows]),
        "step_seconds_p50": p50([r.get("step_seconds") for r in steady]),
        # What N steps take, / N. Async steps come in bursts (with max_staleness 2, two fast steps on batches
        # already there, then one that waits for the engines), so the p50 can sit far below it.
        "step_seconds_mean": mean([r.get("step_seconds") for r in steady]),
        "learn_seconds_p50": p50([r.get("learn_seconds") for r in steady]),
        "train_tokens_per_s_p50": p50([r.get("train_tokens_per_s") for r in steady]),
        "gen_tokens_per_s_p50": p50([r.get("gen_tokens_per_s") for r in steady]),
        # A row counts the tokens of the groups finished since the row before; fixed-length groups finish
        # together, so most async rows count none and the p50 is 0. The rate over the steady steps is the mean.
        "gen_tokens_per_s_mean": _rate(steady),
        "seq_tokens_per_step": p50([r.get("seq_tokens") for r in rows]),
        "micro_batches": p50([r.get("micro_batches") for r in rows]),
        "peak_mem_gib": max((r.get("peak_mem_gib", 0.0) for r in rows), default=None),
        "publish_seconds_p50": p50([r.get("publish_seconds") for r in rows]),
        # Hand-over to every replica serving the version (with sync.overlap_publish it runs beside the
        # next step, and `publish_seconds` is only the trainer's own part).
        "publish_to_served_p50": p50([r.get("publish_to_served_seconds") for r in steady]),
        "publish_blocked_p50": p50([r.get("publish_blocked_seconds") for r in steady]),
        # The hand-over's parts (train_loops/adapter_sync.handover_breakdown), p50 over the steady steps.
        **{f"{k}_p50": p50([r.get(k) for r in steady]) for k in (
            "handover_registry_seconds", "handover_broadcast_seconds", "handover_replica_seconds",
            "handover_fetch_seconds", "handover_add_lora_seconds", "handover_verify_seconds",
            "handover_evict_seconds", "handover_write_seconds")},
        "expired_groups": rows[-1].get("rollout_expired_groups", 0) if rows else None,
        "dropped_samples": rows[-1].get("dropped_samples") if rows else None,
        # of them, groups dropped after a sample of theirs had moved on (rollout.partial)
        "dropped_continued_groups": (summary.get("buffer") or {}).get("dropped_continued_groups"),
        # of them, groups a batch passed over while they were acceptable (the rest finished after their last batch)
        "dropped_waited_groups": (summary.get("buffer") or {}).get("dropped_waited_groups"),
        # rollout.partial (per step): samples continued under a newer version, and the prefill it redid
        "partial_resumed": sum(r.get("partial_resumed", 0) for r in rows),
        "tokens_regenerated": sum(r.get("tokens_regenerated", 0) for r in rows),
        # rollout.partial: the trainer waiting, at each batch, for the version it just published to be served
        "served_wait_seconds_mean": mean([r.get("served_wait_seconds") for r in steady]),
        "published": sum(r.get("published", 0) for r in rows), "aliased": sum(r.get("aliased", 0) for r in rows),
        "final_version": rows[-1].get("version") if rows else None,
        "trainer_idle_fraction": summary.get("trainer_idle_fraction"),
        "generation_idle_fraction": summary.get("generation_idle_fraction"),
        **_multiturn(rows, summary), **_judge(rows), **_eval(summary),
    }


def _judge(rows: list[dict]) -> dict:
    """Judge metrics of a run with reward.judge (none otherwise): the run's totals (each row has them so far)."""
    if not any("judge_calls" in r for r in rows):
        return {}
    return {**{k: max(r.get(k, 0) for r in rows) for k in ("judge_calls", "judge_parse_failures", "judge_timeouts",
                                                            "judge_errors")},
            "judge_seconds_p50": p50([r.get("judge_seconds") for r in rows]),
            "reward_judge_first": rows[0].get("reward_judge"), "reward_judge_last": rows[-1].get("reward_judge")}


def _eval(summary: dict) -> dict:
    """Held-out accuracy at the first and the last evaluation, and the curve (step, accuracy)."""
    evals = [(h["eval/step"], h["eval/accuracy"]) for h in summary.get("eval_history", [])]
    return {"eval_accuracy_first": evals[0][1], "eval_accuracy_last": evals[-1][1], "eval_curve": evals} \
        if evals else {}


def _multiturn(rows: list[dict], summary: dict) -> dict:
    """Episode metrics of a multi-turn run (none for single-turn rows)."""
    if not rows or "episode_turns_mean" not in rows[0]:
        return {}
    hits = sorted(k for r in rows for k in r if k.startswith("prefix_hit_turn"))
    return {"episode_turns_mean_p50": p50([r["episode_turns_mean"] for r in rows]),
            "episode_truncated": sum(r.get("episode_truncated", 0) for r in rows),
            "env_tokens_fraction_p50": p50([r.get("env_tokens_fraction") for r in rows]),
            "env_errors": rows[-1].get("env_errors", 0),
            **{f"{k}_p50": p50([r.get(k) for r in rows]) for k in dict.fromkeys(hits)}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", choices=list(RUNS))
    p.add_argument("--merge", action="store_true", help="sync.mode=merge")
    p.add_argument("--set", action="append", default=[], help="extra config overrides")
    p.add_argument("--tag", default=None, help="record name (default: RUN, plus -merge)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args(argv)

    from app.preflight import free_run_name
    from benchmarks._common import run_driver, stack_versions
    from common import config as C

    recipe, sets, gpus = RUNS[args.run]
    name = args.tag or args.run + ("-merge" if args.merge else "")
    sets = sets + (["sync.mode=merge"] if args.merge else []) + [f"run.name={name}", "run.out_dir=runs/gpu"] + args.set
    cfg = free_run_name(C.load(str(REPO / recipe), sets))  # the run dir read below is the one the run writes
    summary, error, wall = run_driver(cfg, gpus, progress=True)
    run_dir = cfg.run_dir
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line.strip()] if (run_dir / "metrics.jsonl").exists() else []
    command = f"python -m benchmarks.gpu_runs {' '.join(argv if argv is not None else sys.argv[1:])}"
    rec = record(name, cfg, rows, summary, wall, command)
    rec["error"] = error
    import torch

    rec["device"] = (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if torch.cuda.is_available()
                     else "cpu")
    rec["versions"] = stack_versions()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    f = out / "gpu_runs.json"
    doc = json.loads(f.read_text()) if f.exists() else {}
    doc[name] = rec
    f.write_text(json.dumps(doc, indent=2, default=float))
    # The per-step rows behind the record (reward curve, log ratios, timings).
    (out / f"gpu_runs-{name}.metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(json.dumps(rec, indent=2, default=float), flush=True)
    return 0 if error is None else 1


if __name__ == "__main__":
    sys.exit(main())
