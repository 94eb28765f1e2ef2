"""benchmarks/gpu_pipeline.py's rollout phase: router -> replica -> AsyncLLM against a bare AsyncLLM with the same
engine arguments, adapter and prompts, and the bare engine's LoRA decode against the base model."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks._gpu_pipeline_common import REPO, ROLLOUT_MEM, ROLLOUT_REPS, SCRIPT, WORKLOAD, _env, _median
from common.ports import free_port


def _prompts(tok_vocab: int) -> list[list[int]]:
    """16 prompts of exactly 256 token ids (random ids of the model's own vocabulary, no special ones)."""
    import random

    rng = random.Random(0)
    w = WORKLOAD
    return [[rng.randrange(3, tok_vocab) for _ in range(w["prompt_tokens"])] for _ in range(w["prompts_per_step"])]


def _config(model: Path, gpus: int, **rollout):
    from common import config as C

    w = WORKLOAD
    sets = [f"model.path={model}", "model.build_tiny=false", f"model.dtype={w['dtype']}", "model.max_model_len=2048",
            f"lora.rank={w['lora_rank']}", f"lora.alpha={2 * w['lora_rank']}",
            f"rollout.max_lora_rank={w['lora_rank']}", "rollout.replicas=1",
            f"rollout.gpus_per_replica={1 if gpus else 0}", "rollout.enforce_eager=false",
            "rollout.max_num_seqs=256", "rollout.gpu_memory_utilization=0.85", "train.use_gpu=true",
            f"sync.max_staleness={w['max_staleness']}"] + [f"rollout.{k}={v}" for k, v in rollout.items()]
    if not gpus:  # --smoke on CPU
        sets += ["model.dtype=float32", "train.use_gpu=false", "rollout.enforce_eager=true",
                 "rollout.cpus_per_replica=1", "train.gpus_per_worker=0", "train.cpus_per_worker=0.5"]
    return C.load(str(REPO / "recipes" / "gpu-2x.yaml"), sets)


def _random_adapter(model: Path, seed: int = 1) -> tuple[dict, dict]:
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from common.adapter_io import make_meta, peft_config_to_dict

    w = WORKLOAD
    m = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.bfloat16)
    m = get_peft_model(m, LoraConfig(r=w["lora_rank"], lora_alpha=2 * w["lora_rank"],
                                     target_modules=w["target_modules"], lora_dropout=0.0))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.copy_((torch.randn(p.shape, generator=gen) * 0.02).to(p.dtype))
    tensors = {k: v.detach().clone().contiguous() for k, v in get_peft_model_state_dict(m).items()}
    pc = peft_config_to_dict(m.peft_config["default"])
    pc["base_model_name_or_path"] = str(model)
    return tensors, make_meta(tensors, pc, kind="adapter")


def _sampling() -> dict:
    w = WORKLOAD
    return {"max_tokens": w["new_tokens"], "temperature": 1.0, "top_p": 1.0, "logprobs": True,
            "ignore_eos": w["ignore_eos"]}


BARE = "BARE "  # the bare engine's lines on stdout (vLLM logs there too)


def bare_vllm(model: str, adapter_dir: str, mem: float) -> None:
    """A bare AsyncLLM with the replica's engine arguments, the same adapter and sampling, serving passes
    of 16 prompts x 8 samples on request: prints `BARE ready`, then for each `go` line on stdin one pass
    under the adapter (`base`: one without it) and `BARE {"tokens_per_s": ...}`; stops at anything else."""
    import torch

    from serve_deployments.engine_config import engine_env, engine_kwargs

    cfg = _config(Path(model), torch.cuda.device_count(), gpu_memory_utilization=mem)
    os.environ.update(engine_env(cfg))  # the replica's engine environment (engine-core process mode too)
    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.async_llm import AsyncLLM

    kw = engine_kwargs(cfg)
    kw.pop("worker_extension_cls", None)
    w = WORKLOAD
    s = _sampling()
    from vllm.sampling_params import RequestOutputKind

    # What the replica asks of the engine for a rollout (final output only, text decoded once at the end).
    params = SamplingParams(max_tokens=s["max_tokens"], temperature=1.0, logprobs=0, ignore_eos=True,
                            detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)

    async def go():
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kw))
        lora = LoRARequest("policy-v1", 1, adapter_dir)
        await engine.add_lora(lora)
        prompts = _prompts(engine.model_config.get_vocab_size())

        async def one(pid, k, tag, adapter):
            final = None
            async for o in engine.generate({"prompt_token_ids": prompts[pid]}, params, f"{tag}-{pid}-{k}",
                                           lora_request=adapter):
                final = o
            c = final.outputs[0]
            engine.tokenizer.decode(list(c.token_ids), skip_special_tokens=True)
            return len(c.token_ids)

        print(BARE + "ready", flush=True)
        loop = asyncio.get_running_loop()
        rep = 0
        while (cmd := (await loop.run_in_executor(None, sys.stdin.readline)).strip()) in ("go", "base"):
            adapter = lora if cmd == "go" else None
            t0 = time.perf_counter()
            n = await asyncio.gather(*[one(p, k, f"r{rep}", adapter) for p in range(w["prompts_per_step"])
                                       for k in range(w["group_size"])])
            print(BARE + json.dumps({"tokens_per_s": sum(n) / (time.perf_counter() - t0)}), flush=True)
            rep += 1
        engine.shutdown()

    asyncio.run(go())


class _BareEngine:
    """The bare engine's child process, driven a pass at a time (see bare_vllm)."""

    def __init__(self, model: Path, adapter: Path, mem: float, log: Path):
        import queue
        import threading

        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), "_bare", "--model", str(model), "--adapter", str(adapter), "--mem", str(mem)],
            cwd=REPO, env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True)
        self.lines: queue.Queue = queue.Queue()

        def pump():
            with open(log, "w") as f:
                for line in self.proc.stdout:
                    f.write(line)
                    f.flush()
                    if line.startswith(BARE):
                        self.lines.put(line[len(BARE):].strip())
            self.lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        self._expect("ready", timeout=1200)

    def _expect(self, what: str | None = None, timeout: float = 900):
        import queue

        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            line = None
        if line is None or (what is not None and line != what):
            self.close()
            raise RuntimeError(f"bare engine: expected {what or 'a pass'}, got {line!r}; log in {self.log}")
        return line

    def pass_rate(self, adapter: bool = True) -> float:
        self.proc.stdin.write("go\n" if adapter else "base\n")
        self.proc.stdin.flush()
        return float(json.loads(self._expect())["tokens_per_s"])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("stop\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def phase_rollout(args, work: Path, model: Path, out: Path) -> dict:
    """Bare AsyncLLM and router -> replica -> AsyncLLM, both engines alive on the same GPU (each with
    ROLLOUT_MEM of it), their passes interleaved A B B A ...: the GPU's drift over minutes (one lease's
    passes rose or fell by 12% in a row) then hits both sides alike. The ratio is the median over
    rounds of serve / bare within each round; the first round is a warm-up. Each round also has a pass of
    the bare engine without the adapter (the same prompts on the base model): LoRA decode over base, taken
    the same way."""
    import ray
    import torch

    from common.adapter_io import write_peft_dir
    from serve_deployments.app_builder import start_service

    tensors, meta = _random_adapter(model)
    adir = write_peft_dir(tensors, meta["peft_config"], work / "adapter")
    res: dict = {}
    gpus = min(1, torch.cuda.device_count())
    t0 = time.time()
    bare = _BareEngine(model, adir, ROLLOUT_MEM, out / "gpu_pipeline_bare.log")
    res["bare_start_s"] = time.time() - t0
    ray.init(address="local", num_gpus=gpus, include_dashboard=False, runtime_env={"env_vars": {
        "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": _env()["PYTHONPATH"]}})
    # free_port picks outside the range Ray's agents bind in (52365 was taken by the dashboard agent once).
    cfg = _config(model, gpus, http_port=free_port(), gpu_memory_utilization=ROLLOUT_MEM)
    try:
        from common.registry import get_or_create_registry

        registry = get_or_create_registry()
        t0 = time.time()
        handle = start_service(cfg, registry=registry)
        res["serve_start_s"] = time.time() - t0
        ray.get(registry.publish.remote(1, ray.put(tensors), meta))
        w = WORKLOAD
        prompts = _prompts(json.loads((model / "config.json").read_text())["vocab_size"])

        def serve_pass() -> float:
            t0 = time.perf_counter()
            refs = [handle.generate_group.remote(p, w["group_size"], 1, _sampling()) for p in prompts]
            n = sum(len(c["token_ids"]) for r in refs for c in r.result())
            return n / (time.perf_counter() - t0)

        bare_runs, serve_runs, base_runs = [], [], []
        for i in range(ROLLOUT_REPS):
            if i % 2 == 0:
                bare_runs.append(bare.pass_rate())
                serve_runs.append(serve_pass())
                base_runs.append(bare.pass_rate(adapter=False))
            else:
                base_runs.append(bare.pass_rate(adapter=False))
                serve_runs.append(serve_pass())
                bare_runs.append(bare.pass_rate())
            print(f"rollout round {i + 1}/{ROLLOUT_REPS}: bare {bare_runs[-1]:.0f}, serve {serve_runs[-1]:.0f}, "
                  f"base {base_runs[-1]:.0f} tok/s", flush=True)
        ratios = [sv / b for sv, b in zip(serve_runs[1:], bare_runs[1:])]
        lora_ratios = [b / base for b, base in zip(bare_runs[1:], base_runs[1:])]
        res.update({"bare_vllm_tokens_per_s": _median(bare_runs[1:]), "bare_vllm_runs": bare_runs,
                    "rollout_tokens_per_s": _median(serve_runs[1:]), "rollout_runs": serve_runs,
                    "rollout_ratio_runs": ratios, "rollout_vs_bare_vllm": _median(ratios),
                    "rollout_method": f"both engines alive (gpu_memory_utilization {ROLLOUT_MEM} each), passes "
                                      f"interleaved ABBA, {ROLLOUT_REPS} rounds, the first a warm-up; the "
                                      "median of the per-round ratios",
                    "base_vllm_tokens_per_s": _median(base_runs[1:]), "base_vllm_runs": base_runs,
                    "lora_vs_base_runs": lora_ratios, "lora_vs_base_decode": _median(lora_ratios)})
    finally:
        from ray import serve

        bare.close()
        serve.shutdown()
        ray.shutdown()
    return res

