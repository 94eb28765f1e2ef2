"""recipes/real-gemma3-270m.yaml's parts: the generated arithmetic task (answers checked by an independent
solver, a held-out split disjoint from training), the first-boxed reward, and benchmarks/real_model.py
--smoke, the recipe's code path (held-out eval on the wall clock, one trainer and one replica, the record and
its plot) on the embedded tiny model on CPU. The Gemma run itself needs a GPU (results/real_model.json)."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from app.data import DataError, arith_heldout, arith_task, load_prompts
from app.rewards import boxed_math_reward, first_boxed_math_reward
from common import config as C
from common.config import DataConfig

REPO = Path(__file__).resolve().parents[1]
_STEPS = [(r"(?:has|shares) (\d+)", None), (r"with (\d+) \w+ in each", "*"), (r"(?:gets|finds) (\d+) more", "+"),
          (r"gives (\d+)", "-"), (r"among (\d+) friends", "/")]


def solve(prompt: str) -> tuple[int, tuple]:
    """The problem's answer, read off its words (not the generator's tables), and what it asks."""
    events = sorted((m.start(), op, int(m.group(1))) for pat, op in _STEPS for m in re.finditer(pat, prompt))
    (_, first, value), *ops = events
    assert first is None, prompt
    asked = [value]
    for _, op, x in ops:
        assert op is not None and 0 < x < 100, prompt
        if op == "/":
            assert value % x == 0, prompt
        value = {"+": value + x, "-": value - x, "*": value * x, "/": value // x}[op]
        assert 0 < value < 100, prompt  # every intermediate result too
        asked += [op, x]
    return value, tuple(asked)


@pytest.mark.parametrize("steps", [1, 2, None])
def test_arith_answers_numbers_and_heldout_split(steps):
    rows = arith_task(2000, seed=3, steps=steps)
    assert rows[:50] == arith_task(50, seed=3, steps=steps) and rows[:50] != arith_task(50, seed=4, steps=steps)
    for r in rows:
        value, asked = solve(r["prompt"])
        assert str(value) == r["answer"] and len(asked) == 2 * r["steps"] + 1, r
        assert r["prompt"].endswith("Put the final answer in \\boxed{}.")
    assert {r["steps"] for r in rows} == ({1, 2} if steps is None else {steps})
    held = arith_heldout(256, seed=3, steps=steps)
    asked = [solve(r["prompt"])[1] for r in held]
    assert len(set(asked)) == len(held) == 256 and held[0]["id"] == "arith-heldout-0"
    assert [r["answer"] for r in held] == [str(solve(r["prompt"])[0]) for r in held]
    # no held-out problem is asked by a training row of any variant, seed or size
    trained = {solve(r["prompt"])[1] for v in (1, 2, None) for seed in (0, 3) for r in arith_task(4096, seed, v)}
    assert not trained & set(asked)
    if steps == 1:  # every kind is held out, multiplication and division too (their space is small)
        assert {a[1] for a in asked} == {"+", "-", "*", "/"}


def test_arith_builtin_names_and_first_boxed_reward():
    for name, steps in (("arith-1", {1}), ("arith-2", {2}), ("arith-2-heldout", {2}), ("arith", {1, 2})):
        rows = load_prompts(DataConfig(path=f"builtin:{name}", builtin_size=40))
        assert len(rows) == 40 and {r["steps"] for r in rows} == steps, name
    with pytest.raises(DataError, match="arith-1-heldout"):
        load_prompts(DataConfig(path="builtin:arith-3"))
    tail = "12 + 5 = 17. The answer is \\boxed{17}. and then 4 + 3 = 7. The answer is \\boxed{7}."
    assert first_boxed_math_reward(tail, "17") == 1.0 and boxed_math_reward(tail, "17") == 0.0
    assert first_boxed_math_reward("x \\boxed{17", "17") == 0.0 and first_boxed_math_reward("no box 17", "17") == 0.0
    assert first_boxed_math_reward("\\boxed{\\frac{34}{2}} \\boxed{3}", "17") == 1.0  # math-verify compares
    # off the main thread too (the Evaluator and async actors score there; math-verify's alarm is main-only)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(first_boxed_math_reward, "\\boxed{\\frac{34}{2}}", "17").result() == 1.0
        assert pool.submit(boxed_math_reward, "\\boxed{16}", "17").result() == 0.0


@pytest.mark.slow
def test_smoke_run_writes_the_record_and_plot(tmp_path):
    out = tmp_path / "out"
    sets = ["--set", f"model.path={tmp_path / 'tiny-model'}", "--set", f"run.out_dir={tmp_path / 'runs'}"]
    proc = subprocess.run([sys.executable, "-m", "benchmarks.real_model", "--smoke", "--out", str(out),
                           *sets], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    doc = json.loads((out / "real_model_smoke.json").read_text())
    recipe = C.load(str(REPO / "recipes" / "real-gemma3-270m.yaml"))
    assert doc["error"] is None and doc["task"] == recipe.data.path and doc["eval_task"] == recipe.eval.path
    assert doc["reward"] == "app.rewards:first_boxed_math_reward" and doc["eval_samples"] == 8
    assert doc["steps"] == 4 and doc["step_seconds_p50"] > 0
    assert 0 < doc["train_minutes"] < doc["wall_minutes_with_startup"]
    # base model before step 1, then every 2 steps, the last at the final step, on a rising wall clock
    hist = doc["eval_history"]
    assert [h["step"] for h in hist] == [0, 2, 4], hist
    assert hist[0]["minutes"] == 0 and hist[0]["minutes"] < hist[1]["minutes"] < hist[2]["minutes"]
    assert doc["accuracy_before"] == hist[0]["accuracy"] and doc["accuracy_after"] == hist[-1]["accuracy"]
    assert all(0 <= h["accuracy"] <= 1 for h in hist)
    assert doc["device"].startswith("cpu") and "--smoke" in doc["command"] and doc["terms"] is None
    rows = (out / "real_model_smoke.metrics.jsonl").read_text().splitlines()
    assert len(rows) == 4 and all("reward_mean" in json.loads(r) for r in rows)
    assert (out / "real_model_smoke.png").stat().st_size > 10_000
