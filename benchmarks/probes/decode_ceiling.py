"""Probe (GPU): the engine's decode ceiling at the reference workload's shape, with nothing else on the GPU.
One offline vLLM engine (CUDA graphs, base model, gpu_memory_utilization 0.4), N prompts of 256 tokens, 1,024
new tokens (EOS ignored), logprobs=0, for each max_num_seqs given: tok/s of a timed pass after a warm-up.
Usage: python benchmarks/probes/decode_ceiling.py MODEL_DIR OUT_JSON [N] [SEQS,SEQS,...] [QUANTIZATION]
(QUANTIZATION: vLLM's `quantization`, e.g. fp8: weights quantized at load, the decode GEMMs in FP8)"""
import json
import sys
import time


def main(model: str, out: str, n: int, seqs: list[int], quantization: str | None = None) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="bfloat16", gpu_memory_utilization=0.4, max_model_len=2048,
              max_num_seqs=max(seqs), enable_prefix_caching=False, quantization=quantization)
    sp = SamplingParams(temperature=1.0, max_tokens=1024, ignore_eos=True, logprobs=0, detokenize=False)
    prompts = [{"prompt_token_ids": [(i * 7 + j) % 1000 + 10 for j in range(256)]} for i in range(n)]
    llm.generate(prompts[:32], SamplingParams(max_tokens=64, ignore_eos=True), use_tqdm=False)
    res = []
    for s in seqs:  # concurrency capped by feeding at most s prompts per generate call
        t0 = time.perf_counter()
        toks = 0
        for k in range(0, n, s):
            outs = llm.generate(prompts[k:k + s], sp, use_tqdm=False)
            toks += sum(len(o.outputs[0].token_ids) for o in outs)
        dt = time.perf_counter() - t0
        res.append({"concurrency": s, "tokens": toks, "seconds": dt, "tok_s": toks / dt})
        print(json.dumps(res[-1]), flush=True)
        with open(out, "w") as f:
            json.dump({"workload": f"{n} prompts x 256 tokens, 1024 new, base model, CUDA graphs",
                       "quantization": quantization, "runs": res}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 384,
         [int(x) for x in (sys.argv[4] if len(sys.argv) > 4 else "128,384").split(",")],
         sys.argv[5] if len(sys.argv) > 5 else None)
