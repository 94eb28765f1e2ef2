"""Probe: what one decode step of the rollout engine costs, and how much of it is the host's.
One offline vLLM engine, its core in this process (so `py-spy record -- python ...` sees every frame; run with
VLLM_ENABLE_V1_MULTIPROCESSING=1 for the core in its own process, as AsyncLLM runs it),
N prompts of 256 tokens, NEW new tokens (EOS ignored), all N in flight (or --in-flight at a time), after a warm-up
with the same setting and batch.
Reports tok/s and ms per decode step for each sampling setting given (the engine is built once per process;
`--mode` is an engine arg).
Usage: python -m benchmarks.probes.decode_host MODEL_DIR OUT_JSON [--n 384] [--new 1024] [--in-flight 128,384]
         [--logprobs none,0] [--mode processed_logprobs|raw_logprobs] [--lora] [--no-async] [--quantization fp8]
         [--capture-sizes 1,8,...|coarse] [--no-specialize-lora]
`--lora`: a rank-1 adapter of zeros, loaded and used by every request (the rollout's shape).
`--capture-sizes` / `--no-specialize-lora`: the start-up knobs rollout.cudagraph_capture_sizes and
rollout.cudagraph_specialize_lora (`coarse`: COARSE_SIZES); `engine_start_s` in the output is the engine's
construction (weights, compile, graph capture) either way.
py-spy's raw output folds with `benchmarks/probes/fold_pyspy.py`."""
import argparse
import json
import os
import time

from benchmarks._common import stack_versions
from serve_deployments.engine_config import graph_capture_config

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

# 17 batch sizes up to 512 where vLLM captures ~50: decode batches are memory-bound, so a batch padded up to the next
# size costs little, and each size not captured is a graph (twice with LoRA) not built at start-up.
COARSE_SIZES = [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512]


def zero_adapter(model: str, path: str) -> str:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.bfloat16)
    peft = get_peft_model(base, LoraConfig(r=1, lora_alpha=2, target_modules="all-linear"))
    peft.save_pretrained(path)
    return path


def wait_for_peers(spec: str, me: str, tag: str) -> None:
    from pathlib import Path

    folder, n = spec.rsplit(":", 1)
    Path(folder).mkdir(parents=True, exist_ok=True)
    Path(folder, me).touch()
    while len(list(Path(folder).glob(f"{tag}-*"))) < int(n):
        time.sleep(0.05)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--n", type=int, default=384)
    p.add_argument("--new", type=int, default=1024)
    p.add_argument("--logprobs", default="none,0", help="comma list: none or an int, one timed pass each")
    p.add_argument("--mode", default="processed_logprobs")
    p.add_argument("--lora", action="store_true")
    p.add_argument("--no-async", action="store_true")
    p.add_argument("--gpu-mem", type=float, default=0.4)
    p.add_argument("--barrier", default="", help="DIR:N: before each timed pass wait until N processes reach it "
                                                 "(engines side by side on one GPU, timed together)")
    p.add_argument("--in-flight", default="", help="comma list of concurrencies: a timed pass feeds at most this "
                                                   "many prompts per generate call (default: all N at once)")
    p.add_argument("--quantization", default=None, help="vLLM's quantization, e.g. fp8 (weights quantized at load)")
    p.add_argument("--capture-sizes", default="", help="comma list of CUDA graph batch sizes, or coarse")
    p.add_argument("--no-specialize-lora", action="store_true", help="one graph per size, not one with and one "
                                                                     "without an active adapter")
    a = p.parse_args()
    import torch
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest
    kw = {"gpu_memory_utilization": a.gpu_mem} if torch.cuda.is_available() else {}
    if a.no_async:
        kw["async_scheduling"] = False
    in_flight = [int(x) for x in a.in_flight.split(",")] if a.in_flight else [a.n]
    sizes = None if not a.capture_sizes else (
        COARSE_SIZES if a.capture_sizes == "coarse" else [int(x) for x in a.capture_sizes.split(",")])
    compilation = graph_capture_config(sizes, specialize_lora=not a.no_specialize_lora)  # as a replica passes them
    if compilation:
        kw["compilation_config"] = compilation
    t_start = time.perf_counter()
    llm = LLM(model=a.model, dtype="bfloat16", max_model_len=2048, max_num_seqs=max(in_flight),
              enable_prefix_caching=False, logprobs_mode=a.mode, enable_lora=a.lora,
              max_lora_rank=8 if a.lora else 16, quantization=a.quantization, **kw)
    engine_start_s = time.perf_counter() - t_start
    print(json.dumps({"engine_start_s": round(engine_start_s, 1), "compilation_config": compilation}), flush=True)
    lora = LoRARequest("zero", 1, zero_adapter(a.model, "/tmp/decode_host_lora")) if a.lora else None
    vocab = llm.llm_engine.model_config.get_vocab_size()
    prompts = [{"prompt_token_ids": [(i * 7 + j) % (vocab - 20) + 10 for j in range(256)]} for i in range(a.n)]
    runs = []
    for lp in a.logprobs.split(","):
        sp = SamplingParams(temperature=1.0, max_tokens=a.new, ignore_eos=True, detokenize=False,
                            logprobs=None if lp == "none" else int(lp))
        for s in in_flight:
            # a warm-up with this setting and batch first: a sampler path's or a LoRA kernel's first use at a
            # batch size may compile (Triton JIT, seconds)
            warm = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, detokenize=False,
                                  logprobs=sp.logprobs)
            llm.generate(prompts[:s], warm, lora_request=lora, use_tqdm=False)
            if a.barrier:
                wait_for_peers(a.barrier, f"{lp}-{s}-{os.getpid()}", f"{lp}-{s}")
            t0 = time.perf_counter()
            toks = 0
            for k in range(0, a.n, s):
                outs = llm.generate(prompts[k:k + s], sp, lora_request=lora, use_tqdm=False)
                toks += sum(len(o.outputs[0].token_ids) for o in outs)
            dt = time.perf_counter() - t0
            runs.append({"logprobs": lp, "in_flight": s, "tokens": toks, "seconds": round(dt, 3),
                         "tok_s": round(toks / dt), "ms_per_step": round(1000 * dt * s / (a.new * a.n), 2)})
            print(json.dumps(runs[-1]), flush=True)
    doc = {"model": a.model, "n": a.n, "new_tokens": a.new, "logprobs_mode": a.mode, "lora": a.lora,
           "quantization": a.quantization, "compilation_config": compilation,
           "engine_start_s": round(engine_start_s, 2),
           "async_scheduling": llm.llm_engine.vllm_config.scheduler_config.async_scheduling,
           "core_in_process": os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0",
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "versions": stack_versions(), "runs": runs}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
