"""`app serve` on a GPU, checked from outside like a user would: the REST routes answer (models,
completions, chat, streaming, explicit policy versions, tool calls, clear 4xx for bad input), and the served
policy's greedy logprobs equal a PEFT forward of the same adapter (teacher-forced on the engine's
tokens, bf16 tolerance), while the base model's stay the base model's.

    python -m benchmarks.gpu_serve_check --model runs/small-model --adapter runs/gpu/small-1x/adapter

Writes OUT/gpu_serve.json."""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from common.ports import free_port

REPO = Path(__file__).resolve().parents[1]

# A strict tool whose schema bounds its arguments (tests/test_rest_tools.py's on CPU): a named tool_choice must come
# back as one call of it with arguments in the schema, for the base model and the policy alike.
UNIT = {"type": "function", "function": {
    "name": "set_unit", "description": "Set the unit.", "strict": True,
    "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]},
                                                    "n": {"type": "integer", "minimum": 0, "maximum": 9}},
                   "required": ["unit", "n"], "additionalProperties": False}}}

PROMPTS = [f"Say the letter {a}, not {b} or {c}." for a, b, c in
           ["KQZ", "ABC", "XYW", "MNO", "PRS", "TUV", "DEF", "GHJ"]]


def peft_logprobs(model_dir: str, adapter: str | None, prompts: list[list[int]], outs: list[list[int]]):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    if adapter:
        model = PeftModel.from_pretrained(model, adapter, autocast_adapter_dtype=False)
    res = []
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            ids = torch.tensor([p + o]).cuda()
            logp = torch.log_softmax(model(ids).logits[0].float(), -1)
            res.append([float(logp[len(p) - 1 + i, t]) for i, t in enumerate(o)])
    return res


# bf16 tolerance for served vs PEFT logprobs of the same weights: the mean as tight as the trainer/vLLM
# step-1 bound (the goal: <= 0.02); single tokens may differ more (bf16 keeps ~3 significant digits of
# logits around 10-20, and the two stacks sum in different orders).
BF16_TOLERANCE = {"mean": 0.02, "max": 0.25}


def bf16_match(rec: dict, model: str) -> bool:
    return (rec[f"{model}_logprob_abs_diff_mean"] <= BF16_TOLERANCE["mean"]
            and rec[f"{model}_logprob_abs_diff_max"] <= BF16_TOLERANCE["max"])


def tool_call_check(status: int, body: dict | None) -> dict:
    """What one chat response with the strict `set_unit` tool as a named tool_choice did: one call of it, its
    arguments inside UNIT's schema."""
    calls = (body["choices"][0]["message"].get("tool_calls") or []) if status == 200 and body else []
    arguments = json.loads(calls[0]["function"]["arguments"]) if calls else {}
    ok = (len(calls) == 1 and calls[0]["function"]["name"] == "set_unit"
          and arguments.get("unit") in ("c", "f") and 0 <= arguments.get("n", -1) <= 9)
    return {"status": status, "names": [x["function"]["name"] for x in calls], "arguments": arguments, "ok": ok}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--adapter", required=True)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--gpu-fraction", default="0.3")
    args = p.parse_args(argv)
    import httpx
    from transformers import AutoTokenizer

    port = free_port()
    cmd = [sys.executable, "-m", "app", "serve", "--model", args.model, "--adapter", args.adapter, "--port", str(port),
           "--replicas", "1", "--set", "train.use_gpu=true", "--set", "rollout.gpus_per_replica=1",
           "--set", f"rollout.gpu_memory_utilization={args.gpu_fraction}", "--set", "model.dtype=bfloat16"]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))), start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    rec: dict = {"command": "python -m benchmarks.gpu_serve_check " + " ".join(argv or sys.argv[1:]), "checks": {}}
    try:
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.time() - t0 > 400:
                raise RuntimeError(f"app serve not healthy (rc {proc.poll()}) after {time.time() - t0:.0f}s")
            time.sleep(2)
        rec["ready_seconds"] = time.time() - t0
        c = rec["checks"]
        models = httpx.get(f"{base}/v1/models", timeout=30).json()
        ids = sorted(m["id"] for m in models["data"])
        c["models"] = ids
        tok = AutoTokenizer.from_pretrained(args.model)
        prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False) for t in PROMPTS]
        served = {}
        for model in ("policy-v1", "base"):
            outs, lps = [], []
            for pr in prompts:
                r = httpx.post(f"{base}/v1/completions", timeout=60, json={
                    "model": model, "prompt": pr, "max_tokens": 6, "temperature": 0.0, "logprobs": 1,
                    "return_tokens_as_token_ids": True})
                assert r.status_code == 200, r.text
                ch = r.json()["choices"][0]
                outs.append([int(t.split(":")[1]) for t in ch["logprobs"]["tokens"]])
                lps.append(ch["logprobs"]["token_logprobs"])
            served[model] = (outs, lps)
        latest = httpx.post(f"{base}/v1/completions", timeout=60, json={
            "model": "policy-latest", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0.0})
        c["policy_latest_status"], c["policy_latest_model"] = latest.status_code, latest.json().get("model")
        chat = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "model": "policy-v1", "messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 4})
        c["chat_status"], c["chat_text"] = chat.status_code, chat.json()["choices"][0]["message"]["content"]
        with httpx.stream("POST", f"{base}/v1/completions", timeout=60, json={
                "model": "policy-v1", "prompt": PROMPTS[2], "max_tokens": 4, "stream": True}) as s:
            lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
        c["stream_status"], c["stream_chunks"], c["stream_done"] = (
            s.status_code, len(lines), lines[-1] == "data: [DONE]"
        )
        c["tool_calls"] = {}
        # The tiny tokenizer's space and newline would fill max_tokens inside a strict call's arguments.
        no_ws = {str(tok.convert_tokens_to_ids(t)): -100 for t in ("Ġ", "Ċ")}
        for model in ("base", "policy-v1"):
            r = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
                "model": model, "messages": [{"role": "user", "content": "units?"}], "tools": [UNIT],
                "tool_choice": {"type": "function", "function": {"name": "set_unit"}}, "max_tokens": 120,
                "temperature": 0.0, "logit_bias": no_ws})
            c["tool_calls"][model] = tool_call_check(r.status_code, r.json() if r.status_code == 200 else None)
        bad = {"unknown_model": httpx.post(f"{base}/v1/completions", timeout=30,
                                           json={"model": "policy-v999", "prompt": "x"}).status_code,
               "bad_json": httpx.post(f"{base}/v1/completions", timeout=30, content=b"{nope",
                                      headers={"content-type": "application/json"}).status_code,
               "path_model": httpx.post(f"{base}/v1/completions", timeout=30,
                                        json={"model": "/etc/passwd", "prompt": "x"}).status_code}
        c["bad_input_status"] = bad
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    ref = {"policy-v1": peft_logprobs(args.model, args.adapter, prompts, served["policy-v1"][0]),
           "base": peft_logprobs(args.model, None, prompts, served["base"][0])}
    for model in ref:
        diffs = [abs(a - b) for s_lp, r_lp in zip(served[model][1], ref[model]) for a, b in zip(s_lp, r_lp)]
        rec[f"{model}_logprob_abs_diff_max"] = max(diffs)
        rec[f"{model}_logprob_abs_diff_mean"] = sum(diffs) / len(diffs)
    rec["same_greedy_tokens_policy_vs_base"] = sum(a == b for a, b in zip(served["policy-v1"][0], served["base"][0]))
    import torch

    rec["device"] = torch.cuda.get_device_name(0)
    ok = (all(v == 200 for v in (c["policy_latest_status"], c["chat_status"], c["stream_status"]))
          and c["stream_done"] and all(400 <= v < 500 for v in bad.values())
          and all(t["ok"] for t in c["tool_calls"].values())
          and bf16_match(rec, "policy-v1") and bf16_match(rec, "base") and "policy-v1" in ids)
    rec["ok"] = ok
    rec["tolerance"] = BF16_TOLERANCE
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_serve.json").write_text(json.dumps(rec, indent=2))
    print(json.dumps(rec, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
