"""Probe: does the installed stack run here, end to end, in about a minute? The first command on a machine whose
stack was just unpacked (the offline bundle), before anything long is spent on it.

    python -m benchmarks.probes.stack_check OUT.json [--model DIR]

Checks, each recorded with its seconds or its error: the versions; a bf16 matmul on the GPU (when there is one);
a one-rank all-reduce over the trainer's backend with the CUDA libraries torch mapped (collectives_and_libraries);
DeepSpeed's import and accelerator; a vLLM engine on the embedded tiny model (built into --model when missing) with
LoRA enabled, one rank-1 adapter of zeros and per-token logprobs, as the rollout asks; the trainer's forward of the
same tokens through PEFT, whose logprobs must match the engine's (the model is tiny: a loose tolerance)."""
from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path


def _timed(results: dict, name: str, fn):
    t0 = time.perf_counter()
    try:
        results[name] = {"ok": True, **(fn() or {})}
    except Exception as e:  # recorded, and the next check still runs
        results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
    results[name]["seconds"] = round(time.perf_counter() - t0, 2)
    print(json.dumps({name: {k: v for k, v in results[name].items() if k != "trace"}}), flush=True)


def _version(fn) -> str:
    try:
        return str(fn())
    except Exception as e:  # a library that fails to load is the answer, not a crash
        return f"error {type(e).__name__}: {e}"


def collectives_and_libraries(gpu: bool) -> dict:
    """A one-rank all-reduce over the backend DeepSpeed's trainer uses here (NCCL on a GPU, gloo on CPU); on a GPU
    also the versions torch reports for NCCL, cuDNN and cuSPARSELt, and the CUDA library files it mapped. Why: a
    bundle that leaves cuBLAS, NCCL and cuSPARSELt to the image (torch 2.13 pins versions a patch or minor away from
    its copies; docs/GPU.md, "Offline install") is a third smaller, and this check with the matmul says whether the
    image's copies do."""
    import torch
    import torch.distributed as dist

    from common.ports import free_port

    backend = "nccl" if gpu else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        t = torch.ones(4, device="cuda" if gpu else "cpu")
        dist.all_reduce(t)
        if t.tolist() != [1.0] * 4:
            raise AssertionError(f"a one-rank all-reduce of ones gave {t.tolist()}")
    finally:
        dist.destroy_process_group()
    out: dict = {"backend": backend}
    if gpu:
        out.update(nccl=_version(torch.cuda.nccl.version), cudnn=_version(torch.backends.cudnn.version),
                   cusparselt=_version(torch.backends.cusparselt.version))
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if len(line.split()) >= 6}
    libs = ("libcublas", "libnccl", "libcusparseLt", "libcudnn.so")
    out["cuda_libraries"] = sorted(p for p in paths if any(k in p for k in libs))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--model", default="/tmp/stack-check-model")
    a = p.parse_args(argv)

    import torch

    from benchmarks._common import stack_versions

    results: dict = {"versions": stack_versions(),
                     "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    print(json.dumps(results), flush=True)
    gpu = torch.cuda.is_available()
    if gpu:
        def matmul():
            x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                x @ x
            torch.cuda.synchronize()
            return {"tflops": round(20 * 2 * 8192**3 / (time.perf_counter() - t0) / 1e12, 1)}
        _timed(results, "matmul_bf16", matmul)
    _timed(results, "collectives_and_libraries", lambda: collectives_and_libraries(gpu))

    def deepspeed_check():
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        return {"deepspeed": deepspeed.__version__, "accelerator": get_accelerator().device_name()}
    _timed(results, "deepspeed", deepspeed_check)

    model = Path(a.model)

    def build():
        if not (model / "config.json").exists():
            from app.tiny_model import build_model_shape

            build_model_shape(model, "tiny")
    _timed(results, "tiny_model", build)

    adapter = model.parent / (model.name + "-adapter")
    prompts = [[1, 5, 9, 13, 17], [2, 4, 6, 8]]
    engine_out: dict = {}
    # vLLM's GPU LoRA kernels take float16/bfloat16 only (an assert in lora_shrink: the H100 check of 2026-12-05);
    # on CPU float32 keeps the agreement bound tight.
    dtype = "bfloat16" if gpu else "float32"

    def engine():
        from benchmarks.probes.decode_host import zero_adapter

        zero_adapter(str(model), str(adapter))
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest

        llm = LLM(str(model), enforce_eager=True, enable_lora=True, max_lora_rank=8, max_model_len=128,
                  gpu_memory_utilization=0.3 if gpu else 0.9, dtype=dtype)
        outs = llm.generate([{"prompt_token_ids": q} for q in prompts],
                            SamplingParams(max_tokens=8, temperature=1.0, logprobs=0, ignore_eos=True),
                            lora_request=LoRARequest("policy-v1", 1, str(adapter)), use_tqdm=False)
        for q, o in zip(prompts, outs):
            c = o.outputs[0]
            engine_out[tuple(q)] = (list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
        return {"tokens": sum(len(v[0]) for v in engine_out.values())}
    _timed(results, "vllm_lora_logprobs", engine)

    def agreement():
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        dev = "cuda" if gpu else "cpu"
        base = AutoModelForCausalLM.from_pretrained(str(model), torch_dtype=getattr(torch, dtype)).to(dev)
        peft = PeftModel.from_pretrained(base, str(adapter)).eval()
        worst = 0.0
        for q, (toks, lps) in engine_out.items():
            ids = torch.tensor([list(q) + toks], device=dev)
            with torch.no_grad():
                logits = peft(ids).logits.float().log_softmax(-1)[0, len(q) - 1:-1]
            mine = logits.gather(-1, torch.tensor(toks, device=dev)[:, None])[:, 0]
            worst = max(worst, float((mine.cpu() - torch.tensor(lps)).abs().max()))
        if worst > 0.05:
            raise AssertionError(f"trainer and engine logprobs differ by up to {worst:.4f}")
        return {"max_abs_logprob_diff": round(worst, 6)}
    if engine_out:
        _timed(results, "trainer_engine_agreement", agreement)

    results["ok"] = all(v.get("ok", True) for v in results.values() if isinstance(v, dict) and "seconds" in v)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=1))
    print(f"stack check: {'ok' if results['ok'] else 'FAILED'} -> {a.out}", flush=True)
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
