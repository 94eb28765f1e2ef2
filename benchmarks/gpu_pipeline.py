"""The GPU benchmark of issues 9 and 20: where the async LoRA GRPO pipeline stands against its parts and the
hardware, on the GPUs of one machine (one H200 now).

Workload: the `qwen2.5-1.5b` shape (real 151,936 vocabulary, random weights), LoRA rank 1 all-linear,
16 prompts x 8 completions per step, prompts of 256 tokens, exactly 1,024 new tokens (ignore_eos),
async with max_staleness 2.

    python -m benchmarks.gpu_pipeline                      # every phase the machine's GPUs allow
    python -m benchmarks.gpu_pipeline --phases trainer     # one phase (results merge into the JSON)
    python -m app bench gpu_pipeline

A plain run is the published one: the pipeline phase runs under CUDA MPS where the machine supports it (one line
says which; --no-mps for time-sliced) with PIPELINE_DEFAULT_SETS (rollout.max_num_seqs 512) and CUDA graphs, and
each run's record keeps the exact resolved config it ran (`runs.NGPU.MODE.config`).

Phases (each in its own processes, so each starts with a clean GPU):
- trainer (1 GPU): our trainer (train_loops.harness under torchrun, DeepSpeed ZeRO-2, the step's
  micro-batches cut by the token budget) against a plain PEFT loop (HF model + PEFT LoRA, gradient
  checkpointing, sdpa, full logits + log-softmax, 16 sequences per micro-batch) on the same tokens.
  One trainer step runs under torch.profiler: its top ops go to gpu_pipeline_profile.txt.
- rollout (1 GPU): 128 completions through the router -> replica -> AsyncLLM path against a bare
  AsyncLLM with the same engine arguments, adapter and prompts; both engines alive, passes interleaved.
  The bare engine also runs each round's prompts without the adapter: LoRA decode against the base model.
- pipeline: the whole `app train` run, async and then sync, same work: step seconds, publish -> served
  latency, async over sync. On one GPU the trainer and the replica share it (recipes/gpu-1x.yaml, the keys
  end in `_1gpu`); on two, one trains and one serves (recipes/gpu-2x.yaml, `_2gpu`).

- rest: benchmarks/rest_vs_vllm.py on this GPU (our REST through the Serve port and through the REST front,
  rollout.front_port: HAProxy to the replica's own port; against vLLM's own server, each engine 0.4 of the
  GPU): `rest_vs_vllm_serve` and `rest_vs_vllm_front`; its JSON and plot land beside this one as
  rest_vs_vllm_gpu.*. A child stopped by the budget after its last pass still gives them (`--finish` on its
  partial document).

Writes OUT/gpu_pipeline.json (the goal keys at top level; a goal not measured is null with the reason
under `not_measured`; each phase's UTC time under `measured_at`, so one sitting can be told from several)
and OUT/gpu_pipeline.png."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._common import stack_versions
from benchmarks._gpu_pipeline_common import (
    REPO,
    ROLLOUT_MEM,
    SMOKE,
    WORKLOAD,
    _dmon_start,
    _dmon_summary,
    _env,
    _now,
    model_dir,
    run_logged,
    sigint_at,
)
from benchmarks._gpu_pipeline_rollout import bare_vllm, phase_rollout
from benchmarks._gpu_pipeline_trainer import peft_loop, phase_trainer

# Issue 20's goals, all on one GPU.
# Goal 1 is both: the p50 step and 500 steps in <= 34 min (the mean, which bursty async steps can put far
# above the p50).
GOALS = {"step_seconds_1gpu_p50": ("<=", 4.0), "step_seconds_1gpu_mean": ("<=", 34 * 60 / 500),
         "trainer_vs_peft": (">=", 2.0), "rollout_vs_bare_vllm": (">=", 0.95),
         "lora_vs_base_decode": (">=", 0.85), "publish_to_served_p50_s": ("<=", 0.15),
         "async_vs_sync_1gpu": (">=", 1.3), "rest_vs_vllm_serve": (">=", 0.9),
         "rest_vs_vllm_front": (">=", 0.9)}
# The pipeline phase's defaults: the fastest set-up measured on one H200 (BENCHMARKS.md section 14, with --mps and
# CUDA graphs), so that a plain run reproduces the published step time; --pipeline-set overrides them.
PIPELINE_DEFAULT_SETS = ("rollout.max_num_seqs=512",)


# --------------------------------------------------------------------------------------------- pipeline

def phase_pipeline(args, work: Path, model: Path, out: Path) -> dict:
    """`app train` async, then sync, on this machine's GPUs (1 or 2); the keys name the GPU count."""
    import torch

    gpus = min(2, torch.cuda.device_count())
    res: dict = {}
    # A mode run by an earlier invocation (--modes) on as many GPUs still counts.
    runs = dict(args.prev_runs.get(f"{gpus}gpu", {}))
    with contextlib.ExitStack() as stack:
        if args.mps:  # the runs' Ray workers inherit the daemon's pipe folder from this process's environment
            from cluster.gpu_mps import mps_if_supported

            said: list[str] = []  # its one line (on, or off and why), printed and recorded

            def say(line: str) -> None:
                said.append(line)
                print(line, flush=True)

            if stack.enter_context(mps_if_supported(work / "mps", say=say)) is None:
                res["mps_error"] = said[0]  # the lease's minutes still buy the plain run; the record says why
                args.mps = False
        for mode in args.modes.split(","):
            _pipeline_mode(args, work, model, out, gpus, mode, runs, res)
    res["runs"] = {**args.prev_runs, f"{gpus}gpu": runs}
    res.update(pipeline_keys(runs, gpus))
    if args.length_tail:
        res["length_tail"] = args.length_tail
    return res


def pipeline_keys(runs: dict, gpus: int) -> dict:
    """The goal keys from one GPU count's pipeline runs (records by mode: async, async-mps, sync, sync-mps,
    async-partial[-mps]). They take the faster async run of the two set-ups (time-sliced, or under MPS) and
    name it; faster = more steps per hour (the mean step), not the p50. async_vs_sync pairs it with the sync
    run of the same set-up (sync-mps beside async-mps), else the other one, and names that too."""
    res: dict = {}
    timed = [k for k in ("async", "async-mps") if runs.get(k, {}).get("step_seconds_mean")]
    best = min(timed, key=lambda k: runs[k]["step_seconds_mean"]) if timed else "async"
    sync_keys = ("sync-mps", "sync") if best.endswith("-mps") else ("sync", "sync-mps")
    sync = next((k for k in sync_keys if runs.get(k, {}).get("step_seconds_mean")), None)
    a, s = runs.get(best, {}), runs.get(sync, {}) if sync else {}
    if a.get("step_seconds_mean"):
        res["pipeline_async_run"] = best
        res[f"step_seconds_{gpus}gpu_p50"] = a["step_seconds_p50"]
        res[f"step_seconds_{gpus}gpu_mean"] = a["step_seconds_mean"]
        res["publish_to_served_p50_s"] = a.get("publish_to_served_p50") or a.get("publish_seconds_p50")
    if a.get("step_seconds_mean") and s.get("step_seconds_mean"):
        # Steps per hour, async over sync: the same work per step.
        res["pipeline_sync_run"] = sync
        res[f"async_vs_sync_{gpus}gpu"] = s["step_seconds_mean"] / a["step_seconds_mean"]
    # --lever runs (MODE[-mps]+NAME): each one's mean step and its speed-up over the defaults' run of its set-up
    levers = {}
    for k, r in runs.items():
        if "+" in k and r.get("step_seconds_mean"):
            defaults = runs.get(k.split("+")[0], {}).get("step_seconds_mean")
            levers[k] = {"step_seconds_mean": r["step_seconds_mean"], "sets": r.get("sets"),
                         "vs_defaults": defaults / r["step_seconds_mean"] if defaults else None}
    if levers:
        res[f"levers_{gpus}gpu"] = levers
    for partial in ("async-partial", "async-partial-mps"):
        if runs.get(partial, {}).get("step_seconds_mean") and a.get("step_seconds_mean"):
            res[f"partial_vs_async_{gpus}gpu"] = a["step_seconds_mean"] / runs[partial]["step_seconds_mean"]
    if runs.get("async-mps", {}).get("step_seconds_mean"):
        res[f"step_seconds_{gpus}gpu_mps_p50"] = runs["async-mps"]["step_seconds_p50"]
        res[f"step_seconds_{gpus}gpu_mps_mean"] = runs["async-mps"]["step_seconds_mean"]
    return res


def _pipeline_mode(args, work: Path, model: Path, out: Path, gpus: int, mode: str, runs: dict, res: dict) -> None:
    """One `app train` run of the pipeline phase; its record goes to runs[mode] (mode-mps under --mps)."""
    key = f"{mode}-mps" if args.mps else mode
    if args.lever:  # a lever's run is recorded beside the defaults' (levers_1gpu), never in their place
        key = f"{key}+{args.lever}"
    # a length-tailed run has its own files (and document: main), never one of the reference shape's names
    name = (f"tail-{key}" if args.length_tail else key).replace("+", "--")  # file names: no '+' (the lease's copy)
    data = work / ("prompts-tail.jsonl" if args.length_tail else "prompts.jsonl")
    _write_prompts(data, model)
    sets = list(args.pipeline_set)
    if args.length_tail:  # issue 42: each prompt its own long-tailed length (benchmarks/length_tail.py)
        sets += _length_tail(data, args.length_tail)
    if mode == "async-partial":
        mode, sets = "async", [*sets, "rollout.partial=true"]
    steps = args.pipeline_steps if mode == "async" else (args.sync_steps or args.pipeline_steps)
    cmd = [sys.executable, __file__, "_run", "--model", str(model), "--mode", mode, "--data", str(data),
           "--steps", str(steps), "--gpus", str(gpus), "--out", str(work / f"run-{name}.json"),
           *[a for kv in sets for a in ("--set", kv)]]
    limit = _time_left(args)
    if limit is not None:
        cmd += ["--deadline-s", f"{max(limit - STOP_GRACE_S, 30.0):.0f}"]
    t0 = time.time()
    dmon = _dmon_start(out / f"gpu_pipeline_{name}_dmon.txt")
    log = out / f"gpu_pipeline_{name}.log"
    rc = run_logged(cmd, log, limit)
    if dmon is not None:
        dmon.terminate()
    if not (work / f"run-{name}.json").exists():
        res[f"{key}_error"] = f"exit {rc}: " + log.read_text(errors="replace")[-2000:]
        return
    runs[key] = json.loads((work / f"run-{name}.json").read_text())
    runs[key].update(wall_s=time.time() - t0, measured_at=_now(), sets=list(args.pipeline_set), gpu_mps=args.mps)
    for what in ("metrics.jsonl", "profile.txt"):
        if (work / f"run-{name}.{what}").exists():
            (out / f"gpu_pipeline_{name}.{what}").write_text((work / f"run-{name}.{what}").read_text())
    runs[key].update(_dmon_summary(out / f"gpu_pipeline_{name}_dmon.txt"))


# A run stopped at its deadline ends its current step, checkpoints and shuts Ray down: this long.
STOP_GRACE_S = 75.0


def _time_left(args) -> float | None:
    """Seconds left of --budget-s (None: no budget)."""
    if not args.budget_s:
        return None
    return args.budget_s - (time.time() - args.started)



def _write_prompts(path: Path, model: Path) -> None:
    """Prompts whose chat rendering is exactly 256 tokens (the embedded tokenizer is one token per
    character), answers unused (hash_reward)."""
    import random

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    rendered = tok.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=True, tokenize=False)
    base = len(tok.encode(rendered, add_special_tokens=False))
    rng = random.Random(0)
    n = WORKLOAD["prompt_tokens"] - base
    with path.open("w") as f:
        for i in range(512):
            text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(n))
            f.write(json.dumps({"id": f"p{i}", "prompt": text, "answer": "a"}) + "\n")


def _length_tail(data: Path, spec: str) -> list[str]:
    """Rewrite the prompts with a long-tailed `max_new_tokens` each; the config keys that use it."""
    from benchmarks.length_tail import COLUMN, draw_lengths, parse_spec, with_lengths, write_jsonl

    tail = parse_spec(spec)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    write_jsonl(data, with_lengths(rows, draw_lengths(len(rows), tail["median"], tail["sigma"], tail["hi"],
                                                      tail["lo"], seed=0)))
    return [f"data.max_tokens_column={COLUMN}", f"grpo.max_new_tokens={tail['hi']}",
            f"model.max_model_len={WORKLOAD['prompt_tokens'] + tail['hi'] + 16}"]


def pipeline_run(model: str, mode: str, data: str, steps: int, gpus: int, out: str, extra: list[str],
                 deadline_s: float | None = None) -> None:
    import ray

    from app import driver
    from app.preflight import free_run_name
    from benchmarks.gpu_runs import record
    from common import config as C

    w = WORKLOAD
    sets = [f"model.path={model}", "model.build_tiny=false", f"model.dtype={w['dtype']}", "model.max_model_len=2048",
            f"data.path={data}", "reward.fn=benchmarks.rewards:hash_reward", f"lora.rank={w['lora_rank']}",
            f"lora.alpha={2 * w['lora_rank']}", f"rollout.max_lora_rank={w['lora_rank']}",
            f"grpo.prompts_per_step={w['prompts_per_step']}", f"grpo.group_size={w['group_size']}",
            f"grpo.max_new_tokens={w['new_tokens']}", "grpo.ignore_eos=true", "grpo.lr=1e-4",
            f"sync.max_staleness={w['max_staleness']}", f"train.total_steps={steps}", "checkpoint.every=0",
            "rollout.enforce_eager=false", "rollout.groups_per_worker=12",
            "train.mps=false",  # the daemon is this benchmark's own (--mps), around the whole phase
            f"run.mode={mode}", f"run.name=gpu-pipeline-{mode}-{gpus}gpu", "run.out_dir=runs/gpu"]
    # One GPU: the recipe's split (the engine takes gpu_memory_utilization 0.3 of it, the trainer the rest);
    # two: the rollout GPU is the engine's alone.
    recipe = "gpu-1x.yaml" if gpus == 1 else "gpu-2x.yaml"
    if gpus == 2:
        sets.append("rollout.gpu_memory_utilization=0.85")
    cfg = free_run_name(C.load(str(REPO / "recipes" / recipe), sets + extra))  # the run dir read below is the run's
    ray.init(address="local", num_gpus=gpus, include_dashboard=False, runtime_env={"env_vars": {
        "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": _env()["PYTHONPATH"]}})
    t0 = time.time()
    err, fired = None, []
    try:
        with sigint_at(deadline_s) as fired:  # the lease call's limit: keep the steps done so far
            summary = driver.run(cfg, progress=True)
    except (Exception, KeyboardInterrupt) as e:
        err, summary = f"{type(e).__name__}: {e}"[-2000:], {}
    rows = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()] \
        if (cfg.run_dir / "metrics.jsonl").exists() else []
    rec = record(f"pipeline-{mode}", cfg, rows, summary, time.time() - t0, "")
    rec["error"] = err
    rec["stopped_at_deadline"] = bool(fired)
    rec["config"] = json.loads(json.dumps(cfg.to_dict(), default=str))  # the exact resolved config it ran
    Path(out).write_text(json.dumps(rec, default=float))
    # Beside the record: the run's rows and, with train.profile_step, the trainer's profile.
    for src, name in (("metrics.jsonl", "metrics.jsonl"), ("profile.txt", "profile.txt")):
        if (cfg.run_dir / src).exists():
            Path(out).with_name(f"{Path(out).stem}.{name}").write_text((cfg.run_dir / src).read_text())
    ray.shutdown()


def phase_rest(args, work: Path, model: Path, out: Path) -> dict:
    """benchmarks/rest_vs_vllm.py in its own processes, on the phase's model; its goal keys."""
    device = "gpu" if _gpus() else "cpu"
    cmd = [sys.executable, "-m", "benchmarks.rest_vs_vllm", "--shape", args.shape, "--work", str(work),
           "--out", str(out), "--sides", "rest,front"]
    cmd += ["--smoke"] if os.environ.get("GPU_PIPELINE_SMOKE") == "1" else []
    log = out / f"rest_vs_vllm_{device}.log"
    t0 = time.time() - 1
    rc = run_logged(cmd, log, _time_left(args))
    text = log.read_text(errors="replace")
    print(text[-3000:], flush=True)
    return rest_keys(out, device, t0, f"exit {rc}: " + text[-2000:], " ".join(["python", *cmd[1:]]))


def rest_keys(out: Path, device: str, t0: float, failure: str, command: str) -> dict:
    """The rest goal keys from the run's document, written after t0 (--out may hold an earlier run's). A run
    stopped after its last pass (killed while its servers stopped) still has them: `--finish` makes the
    document from its partial one. Otherwise the error, and how far the run got."""
    f = out / f"rest_vs_vllm_{device}.json"
    partial = out / f"rest_vs_vllm_{device}_partial.json"

    def new(path: Path) -> bool:
        return path.exists() and path.stat().st_mtime >= t0

    if not new(f) and new(partial):  # --finish refuses one whose passes are not all done
        run_logged([sys.executable, "-m", "benchmarks.rest_vs_vllm", "--finish", str(partial)],
                   out / f"rest_vs_vllm_{device}_finish.log", 120)
    if not new(f):
        res = {"rest_error": failure}
        if new(partial):  # the passes it finished, and its last stage
            p = json.loads(partial.read_text())
            res["rest_partial"] = {"file": partial.name, "passes_done": p.get("passes_done"),
                                   "passes": p.get("passes"), "reason": p.get("partial_reason")}
        return res
    rest = json.loads(f.read_text())
    key = f"rest_vs_vllm_serve_{device}"
    return {"rest_vs_vllm_serve": rest[key], "rest_vs_vllm_front": rest.get(f"{key}_front"),
            **({"rest_vs_vllm_serve_replica_port": rest[f"{key}_replica_port"]} if f"{key}_replica_port" in rest
               else {}),
            **({"rest_finished_from_partial": rest["finished_from_partial"]} if "finished_from_partial" in rest
               else {}),
            "rest": {"json": f.name, "command": command,
                     "endpoints": {ep: {k: v for k, v in e.items() if "ratio" in k}
                                   for ep, e in rest["endpoints"].items()}}}


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


# ----------------------------------------------------------------------------------------------- report

def finish(doc: dict, gpus: int, out: Path) -> dict:
    no_gpu = "no GPU here: the pipeline phase runs on a GPU machine"
    pipe = no_gpu if not gpus else \
        "the pipeline phase was not run, or its run ended before its steady steps (see runs, *_error)"
    other = "phase failed or not run; see the phase's error key"
    reasons = {"step_seconds_1gpu_p50": pipe, "step_seconds_1gpu_mean": pipe, "async_vs_sync_1gpu": pipe,
               "publish_to_served_p50_s": pipe,
               "rest_vs_vllm_serve": "the rest phase was not run",
               "rest_vs_vllm_front": "the rest phase was not run"}
    generic = {no_gpu, pipe, other, *reasons.values()}  # a reason written by hand into the JSON stays
    doc.setdefault("not_measured", {})
    for k in GOALS:
        if doc.get(k) is None:
            doc[k] = None
            if doc["not_measured"].get(k) in (None, *generic):  # an earlier invocation's may be out of date
                doc["not_measured"][k] = reasons.get(k, other)
        else:
            doc["not_measured"].pop(k, None)
    doc["goals"] = {k: {"goal": f"{op} {v}", "measured": doc.get(k),
                        "met": None if doc.get(k) is None else (doc[k] <= v if op == "<=" else doc[k] >= v)}
                    for k, (op, v) in GOALS.items()}
    try:
        _plot(doc, out / "gpu_pipeline.png")
    except Exception as e:  # a missing matplotlib must not lose the numbers
        doc["plot_error"] = str(e)
    return doc


def _plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(GOALS)
    fig, ax = plt.subplots(figsize=(9, 4))
    for i, k in enumerate(keys):
        op, goal = GOALS[k]
        v = doc.get(k)
        # Plotted as "fraction of goal", higher is better for every key.
        frac = None if v is None else (goal / v if op == "<=" else v / goal)
        ax.bar(i, frac or 0, color="tab:green" if frac and frac >= 1 else "tab:red")
        ax.text(i, (frac or 0) + 0.03, "n/m" if v is None else f"{v:.3g}\n({op} {goal})", ha="center", fontsize=8)
    ax.axhline(1.0, color="k", lw=1, ls="--")
    ax.set_ylim(0, max([1.0] + [b.get_height() for b in ax.patches]) * 1.25)
    ax.set_xticks(range(len(keys)), keys, rotation=15, fontsize=8)
    ax.set_ylabel("measured / goal (>= 1 is met)")
    ax.set_title(f"gpu_pipeline: {doc.get('device', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The main command's arguments; --pipeline-set follows PIPELINE_DEFAULT_SETS (a later set wins)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phases", default="trainer,rollout,pipeline")
    p.add_argument("--trainer-steps", type=int, default=5)
    p.add_argument("--pipeline-steps", type=int, default=12)
    p.add_argument("--sync-steps", type=int, default=8, help="steps of the sync comparison run")
    p.add_argument("--modes", default="async,sync", help="pipeline phase: which runs (async, sync, async-partial: "
                                                          "async with rollout.partial)")
    p.add_argument("--length-tail", default="", metavar="MEDIAN:SIGMA:MAX",
                   help="pipeline phase: each prompt's completion length drawn log-normal, clipped to MAX "
                        "(issue 42's length-tailed shape, e.g. 400:1.0:3000; default: every completion 1,024)")
    p.add_argument("--trainer-set", action="append", default=[], help="trainer phase: config KEY=VALUE")
    p.add_argument("--pipeline-set", action="append", default=[],
                   help="pipeline phase: config KEY=VALUE, after the measured-best defaults "
                        f"({', '.join(PIPELINE_DEFAULT_SETS)}; a later set wins)")
    p.add_argument("--lever", default="", metavar="NAME",
                   help="pipeline phase: record the runs as MODE[-mps]+NAME (with the --pipeline-set that makes the "
                        "lever), beside the defaults' runs and compared with them (levers_1gpu), never in their place")
    p.add_argument("--mps", action=argparse.BooleanOptionalAction, default=True,
                   help="pipeline phase: under a CUDA MPS daemon (cluster/gpu_mps.py) where the machine supports it, "
                        "else time-sliced with one line saying why; runs recorded as MODE-mps (default: on, the "
                        "measured best; --no-mps for the time-sliced run)")
    p.add_argument("--trainer-ablation", default="",
                   help="trainer phase: extra runs, ';'-separated, each a ','-separated KEY=VALUE list")
    p.add_argument("--shape", default=WORKLOAD["shape"], help="model shape")
    p.add_argument("--smoke", action="store_true", help="CPU check of the script: tiny shape, short sequences")
    p.add_argument("--work", default=None, help="where models and runs go (default: a temp dir)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="end within this many seconds (a lease call's limit): a pipeline run is asked to stop "
                        f"{STOP_GRACE_S:.0f} s before and keeps the steps it made; 0: no limit")
    args = p.parse_args(argv)
    args.pipeline_set = [*PIPELINE_DEFAULT_SETS, *args.pipeline_set]
    if args.lever and not args.lever.replace("-", "").replace("_", "").isalnum():
        p.error(f"--lever: a name of letters, digits, - and _ (it names files), got {args.lever!r}")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("_peft", "_bare", "_run"):  # the phases' child processes
        p = argparse.ArgumentParser()
        p.add_argument("what")
        p.add_argument("--model")
        p.add_argument("--adapter")
        p.add_argument("--steps", type=int, default=4)
        p.add_argument("--mode")
        p.add_argument("--data")
        p.add_argument("--mem", type=float, default=ROLLOUT_MEM)
        p.add_argument("--gpus", type=int, default=1)
        p.add_argument("--out")
        p.add_argument("--set", action="append", default=[])
        p.add_argument("--deadline-s", type=float, default=None)
        a = p.parse_args(argv)
        if a.what == "_peft":
            Path(a.out).write_text(json.dumps(peft_loop(a.model, a.steps, micro=16)))
        elif a.what == "_bare":
            bare_vllm(a.model, a.adapter, a.mem)
        else:
            pipeline_run(a.model, a.mode, a.data, a.steps, a.gpus, a.out, a.set, a.deadline_s)
        return 0

    args = parse_args(argv)
    args.started = time.time()

    import torch

    if args.smoke:
        os.environ["GPU_PIPELINE_SMOKE"] = "1"
        WORKLOAD.update(SMOKE)
        args.shape = "tiny"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu-pipeline-"))
    work.mkdir(parents=True, exist_ok=True)
    gpus = torch.cuda.device_count()
    # issue 42's length-tailed runs are their own document: their async run is not the reference shape's
    f = out / ("gpu_pipeline_length_tail.json" if args.length_tail else "gpu_pipeline.json")
    doc = json.loads(f.read_text()) if f.exists() else {}
    doc.update({"device": f"{gpus} x {torch.cuda.get_device_name(0)}" if gpus else "cpu",
                "workload": {**WORKLOAD, "shape": args.shape}, "versions": stack_versions(),
                "command": "python -m benchmarks.gpu_pipeline " + " ".join(argv)})
    model = model_dir(work, args.shape)
    args.prev_runs = {k: v for k, v in doc.get("runs", {}).items() if k.endswith("gpu")}
    phases = [x for x in args.phases.split(",") if x]
    for ph in phases:
        if ph == "pipeline" and not gpus:
            continue  # finish() names the keys it leaves unmeasured
        t0 = time.time()
        print(f"phase {ph} ...", flush=True)
        fn = {"trainer": phase_trainer, "rollout": phase_rollout, "pipeline": phase_pipeline, "rest": phase_rest}[ph]
        res = fn(args, work, model, out)
        res[f"{ph}_phase_s"] = time.time() - t0
        doc.setdefault("measured_at", {})[ph] = _now()
        doc.update(res)
        print(json.dumps(res, default=float)[:3000], flush=True)
        f.write_text(json.dumps(finish(doc, gpus, out), indent=2, default=float))
    doc = finish(doc, gpus, out)
    f.write_text(json.dumps(doc, indent=2, default=float))
    print(json.dumps({k: doc.get(k) for k in GOALS}, default=float), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
