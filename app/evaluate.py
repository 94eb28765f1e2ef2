"""Evaluation through the served policy: held-out prompts (`eval.path`) -> the router's `generate_group`
(the same handle API, routing and replicas as the rollouts) under one pinned version -> the run's reward
-> `eval/accuracy` (pass@1, greedy) and, with `eval.pass_k` > 1, `eval/pass@k` (k samples at
grpo.temperature, any of them correct). A completion is correct when its reward is >= 1 (the full score
of the 0/1 rewards in app/rewards.py).

During training the driver kicks an `Evaluator` actor every `eval.every` steps and collects the result
later (it never waits for it while a step is due); `python -m app eval` runs the same code once on a base
model or a saved adapter.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time

import ray

from common.config import Config, from_dict

CORRECT = 1.0  # a reward at least this counts as a correct answer
EVAL_CONCURRENCY = 8  # eval prompts in flight at once: interleaved with the rollouts, never flooding them


def eval_rows(cfg: Config, path: str | None = None, samples: int | None = None) -> list[dict]:
    """The first `eval.samples` rows of `eval.path`, read like data.path (same columns, same checks)."""
    from app.data import load_prompts

    n = samples or cfg.eval.samples
    dc = dataclasses.replace(cfg.data, path=path or cfg.eval.path, builtin_size=n)
    return load_prompts(dc)[:n]


def score_eval(greedy: list[float], sampled: list[list[float]] | None = None, k: int = 1) -> dict:
    """Rewards -> metrics. greedy: one reward per prompt (its greedy completion); sampled: k rewards per
    prompt (or None). eval/accuracy = fraction of prompts answered correctly greedily (pass@1),
    eval/reward_mean = their mean reward, eval/pass@k = fraction with any of the k samples correct."""
    if not greedy:
        raise ValueError("score_eval: no prompts")
    out = {"eval/accuracy": sum(r >= CORRECT for r in greedy) / len(greedy),
           "eval/reward_mean": sum(greedy) / len(greedy), "eval/samples": len(greedy)}
    if sampled is not None and k > 1:
        if len(sampled) != len(greedy) or any(len(s) != k for s in sampled):
            raise ValueError(f"score_eval: expected {k} sampled rewards for each of {len(greedy)} prompts")
        out[f"eval/pass@{k}"] = sum(any(r >= CORRECT for r in s) for s in sampled) / len(sampled)
    return out


def pick_version(live: list[int], want: int | None) -> int | None:
    """The version to evaluate: `want` if live; else the newest live one not newer than it (a step off
    the sync.every grid published nothing); else the newest live one; None = whatever the router serves
    (the base model when nothing is live)."""
    if want is None or not live:
        return live[-1] if live else None
    if want in live:
        return want
    older = [v for v in live if v <= want]
    return older[-1] if older else live[-1]


@ray.remote(num_cpus=0)
class Evaluator:
    """Holds the eval prompts, tokenizer and reward; `run(version, step)` scores one version."""

    def __init__(self, cfg: dict, rows: list[dict]):
        from transformers import AutoTokenizer

        from app.data import render_prompt
        from app.rewards import load_scorer

        self.cfg: Config = from_dict(cfg)
        self.rows = rows
        self.tokenizer = AutoTokenizer.from_pretrained(self.cfg.model.path)
        self.prompts = [render_prompt(r, self.tokenizer, self.cfg.data) for r in rows]
        self.scorer = load_scorer(self.cfg.reward.fn)
        self._handle = None

    def _router(self):
        if self._handle is None:
            from ray import serve

            self._handle = serve.get_app_handle(self.cfg.rollout.app_name)
        return self._handle

    async def _one(self, sem: asyncio.Semaphore, ids: list[int], row: dict, version: int | None, k: int
                   ) -> tuple[float, list[float] | None, int]:
        g = self.cfg.grpo
        async with sem:
            greedy = await self._router().generate_group.remote(
                ids, 1, version, {"max_tokens": g.max_new_tokens, "temperature": 0.0, "logprobs": False})
            sampled = None
            if k > 1:
                sampled = await self._router().generate_group.remote(
                    ids, k, version, {"max_tokens": g.max_new_tokens, "temperature": g.temperature,
                                      "top_p": g.top_p, "logprobs": False})
        score = lambda c: float(self.scorer(c["text"], row, c.get("finish_reason")))  # noqa: E731
        return score(greedy[0]), [score(c) for c in sampled] if sampled else None, int(greedy[0]["version"])

    async def run(self, version: int | None = None, step: int = 0) -> dict:
        """Score the eval prompts under one version (see pick_version); returns eval/* metrics plus
        eval/version (what was served) and eval/step (the step it belongs to)."""
        t0 = time.perf_counter()
        live = list(await self._router().live_versions.remote())
        v = pick_version(live, version)
        k = self.cfg.eval.pass_k
        sem = asyncio.Semaphore(EVAL_CONCURRENCY)
        res = await asyncio.gather(*(self._one(sem, ids, row, v, k) for ids, row in zip(self.prompts, self.rows)))
        out = score_eval([r[0] for r in res], [r[1] for r in res] if k > 1 else None, k)
        served = {r[2] for r in res}
        out.update({"eval/version": max(served), "eval/step": int(step), "eval/seconds": time.perf_counter() - t0})
        return out


def eval_main(argv: list[str] | None = None) -> int:
    """`python -m app eval --model DIR [--adapter DIR] --data FILE_OR_BUILTIN [--samples N]`."""
    import argparse
    import json
    import sys

    p = argparse.ArgumentParser(prog="python -m app eval", description=(
        "Score a model (or a saved PEFT adapter on it) on held-out prompts through the served policy: "
        "starts the service, runs the training-time evaluation once, prints accuracy, stops."))
    p.add_argument("--model", required=True, help="HF model directory")
    p.add_argument("--adapter", help="saved PEFT adapter directory (served as policy-v1)")
    p.add_argument("--data", required=True, help="parquet/JSONL/dir like data.path, or builtin:letters-heldout")
    p.add_argument("--samples", type=int, default=None, help="eval prompts (default eval.samples)")
    p.add_argument("--pass-k", type=int, default=None, help="also report pass@k (k samples at grpo.temperature)")
    p.add_argument("--config", help="YAML config for the rest (reward, columns, engine)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--json", action="store_true", help="print the metrics as JSON")
    p.add_argument("--verbose", action="store_true", help="stream Ray, Serve and vLLM logs")
    args = p.parse_args(argv)

    from app.data import DataError
    from common import config as config_mod
    from common.adapter_io import AdapterError
    from serve_deployments.app_builder import read_adapter_payload

    sets = list(args.set) + [f"model.path={args.model}", "model.build_tiny=false", f"eval.path={args.data}",
                             "rollout.workers=1"]
    if args.samples is not None:
        sets.append(f"eval.samples={args.samples}")
    if args.pass_k is not None:
        sets.append(f"eval.pass_k={args.pass_k}")
    payload = None
    try:
        if args.adapter:  # read before starting anything: a bad directory fails fast
            payload, sets = read_adapter_payload(args.adapter, sets)
        cfg = config_mod.load(args.config, sets)
        rows = eval_rows(cfg)
    except (config_mod.ConfigError, AdapterError, DataError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    metrics = evaluate_service(cfg, rows, payload, verbose=args.verbose)
    what = f"{args.adapter} on {args.model}" if args.adapter else args.model
    if args.json:
        print(json.dumps(metrics))
    line = (f"eval: {what} on {args.data}: accuracy {metrics['eval/accuracy']:.3f} "
            f"({metrics['eval/samples']} prompts, greedy)")
    if cfg.eval.pass_k > 1:
        line += f", pass@{cfg.eval.pass_k} {metrics[f'eval/pass@{cfg.eval.pass_k}']:.3f}"
    print(line, flush=True)
    return 0


def evaluate_service(cfg: Config, rows: list[dict], payload=None, verbose: bool = False) -> dict:
    """Start the service (the adapter published first, as `app serve` does), score once, tear down."""
    from pathlib import Path

    from ray import serve

    from app.driver import Console, _init_ray, _kill
    from common.registry import get_or_create_registry
    from serve_deployments.app_builder import start_with_adapter, wait_healthy

    cfg.model.path = str(Path(cfg.model.path).resolve())
    started = not ray.is_initialized()
    console = Console(None, verbose)
    _init_ray(cfg, verbose=verbose)
    console.adopt_ray_loggers()
    registry = get_or_create_registry()
    evaluator = None
    try:
        handle, version = start_with_adapter(cfg, registry, payload)
        wait_healthy(handle)
        evaluator = Evaluator.remote(cfg.to_dict(), rows)
        return ray.get(evaluator.run.remote(version, 0))
    finally:
        if evaluator is not None:
            _kill(evaluator)
        try:
            serve.delete(cfg.rollout.app_name)
        except Exception:
            pass
        _kill(registry)
        if started:
            ray.shutdown()
        console.close()
