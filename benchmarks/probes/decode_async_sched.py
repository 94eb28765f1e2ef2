"""Probe (GPU): does vLLM's async scheduling speed up the workload's decode? One engine per setting, in its
own process: 128 prompts of 256 tokens, 512 new tokens (EOS ignored), base model, tok/s of a timed pass
after a warm-up pass. Usage: python -m benchmarks.probes.decode_async_sched MODEL_DIR OUT_JSON [true|false]"""
import json
import subprocess
import sys
import time


def one(model: str, async_sched: bool) -> dict:
    from vllm import LLM, SamplingParams

    kw = {"async_scheduling": True} if async_sched else {}
    llm = LLM(model=model, dtype="bfloat16", gpu_memory_utilization=0.4, max_model_len=2048, max_num_seqs=256,
              enable_prefix_caching=False, **kw)
    sp = SamplingParams(temperature=1.0, max_tokens=512, ignore_eos=True, logprobs=0, detokenize=False)
    prompts = [{"prompt_token_ids": [(i * 7 + j) % 1000 + 10 for j in range(256)]} for i in range(128)]
    llm.generate(prompts[:16], sp, use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"async_scheduling": async_sched, "tokens": n, "seconds": dt, "tok_s": n / dt,
            "ms_per_decode_step": 1000 * dt / 512}


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("Usage:")[0])
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("async_scheduling", nargs="?", choices=["true", "false"],
                    help="one run in this process (the parent runs both, each in a child)")
    a = ap.parse_args()
    model, out = a.model, a.out
    if a.async_scheduling:
        print(json.dumps(one(model, a.async_scheduling == "true")), flush=True)
        sys.exit(0)
    res = []
    for a in ("false", "true"):
        p = subprocess.run([sys.executable, "-m", __spec__.name, model, out, a], capture_output=True, text=True,
                           timeout=200)
        line = [x for x in p.stdout.splitlines() if x.startswith("{")]
        res.append(json.loads(line[-1]) if line else {"async_scheduling": a, "error": p.stderr[-1500:]})
        print(res[-1], flush=True)
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
