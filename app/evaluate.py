"""Evaluation through the served policy: held-out prompts (`eval.path`) -> the ingress's `generate_group`
(the same handle API, routing and replicas as the rollouts) under one pinned version -> the run's reward
-> `eval/accuracy` (pass@1, greedy) and, with `eval.pass_k` > 1, `eval/pass@k` (k samples at
grpo.temperature, any of them correct). A completion is correct when its reward is >= 1 (the full score
of the 0/1 rewards in app/rewards.py). In a multi-turn run each prompt is an episode scored like the rollouts,
and an environment that reports reward parts (a verifiers environment's functions; its held-out tasks are
`eval.path: verifiers`, app/verifiers_eval.py) gets each part's mean greedy score as `eval/reward/NAME`.

During training the driver kicks an `Evaluator` actor every `eval.every` steps and collects the result
later (it never waits for it while a step is due; app/eval_schedule.py); `python -m app eval` runs the same
code once on a base model or a saved adapter (`evaluate_service`).
"""
from __future__ import annotations

import asyncio
import time

import ray

from common.config import Config, from_dict
from common.registry import pick_version

CORRECT = 1.0  # a reward at least this counts as a correct answer
MIN_EVAL_CONCURRENCY = 8


def eval_concurrency(cfg: Config) -> int:
    """eval.concurrency, or by default a quarter of the replicas' vLLM slots: an eval in a few waves of requests
    (each waits about one rollout turn in the engines' queues), its requests never more than a quarter of a batch."""
    if cfg.eval.concurrency is not None:
        return cfg.eval.concurrency
    return max(MIN_EVAL_CONCURRENCY, cfg.rollout.replicas * cfg.rollout.max_num_seqs // 4)


# The version under evaluation is held live in the registry (a lease) until the eval ends, at most this long:
# an eval of 128 prompts took 67 s on one H200 while versions turned over every 4 s.
EVAL_HOLD_S = 900.0
HOLDER = "evaluator"
EPISODE_ATTEMPTS = 3  # an eval episode whose version left the live window starts over under the newest


def eval_rows(cfg: Config, path: str | None = None, samples: int | None = None) -> list[dict]:
    """The first `eval.samples` rows of `eval.path`, read like data.path (same columns, same checks)."""
    from app import reasoning_gym_tasks, verifiers_eval
    from app.data import load_prompts
    from common.config import VERIFIERS_EVAL

    count, path = samples or cfg.eval.samples, path or cfg.eval.path
    if reasoning_gym_tasks.is_reasoning_gym(path):  # held out from the training items
        return reasoning_gym_tasks.eval_rows(cfg.replace(eval={"path": path}), count)
    if path == VERIFIERS_EVAL:  # the environment's tasks, held out from the training ones
        return verifiers_eval.eval_rows(cfg, count)
    return load_prompts(cfg.data.replace(path=path, builtin_size=count, mix=[], args={}))[:count]


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


def reward_parts(parts: list[dict[str, float]]) -> dict[str, float]:
    """`eval/reward/NAME`: each reward function's mean score over the episodes that were scored (a failed one has
    no scores; it counts in eval/env_errors)."""
    names = sorted({name for p in parts for name in p})
    return {f"eval/reward/{name}": sum(p[name] for p in parts if name in p) / sum(name in p for p in parts)
            for name in names}


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
        self.scorer = load_scorer(self.cfg.reward.fn) if self.cfg.reward.fn else None
        self.episodes = None
        if self.cfg.env.episodic:  # multi-turn: each eval prompt is an episode, scored like the rollouts
            from app.episodes import EpisodeRollout
            from app.verifiers_eval import eval_config

            # a verifiers environment as its held-out tasks load it (eval.args): their task config and rubric
            self.episodes = EpisodeRollout(eval_config(self.cfg), self.tokenizer, self.scorer)
            self.prompts = [[] for _ in rows]
        else:
            self.prompts = [render_prompt(r, self.tokenizer, self.cfg.data) for r in rows]
        self.env_errors = 0
        self._handle = None

    def _registry(self):
        """The run's AdapterRegistry, or None (a service started without one)."""
        from common.names import REGISTRY_NAME
        from common.run_ingress import run_namespace_of

        try:
            return ray.get_actor(REGISTRY_NAME, namespace=run_namespace_of(self.cfg))
        except ValueError:
            return None

    def _ingress(self):
        if self._handle is None:
            from common.run_ingress import ingress_for

            self._handle = ingress_for(self.cfg)
        return self._handle

    async def _one(self, sem: asyncio.Semaphore, ids: list[int], row: dict, version: int | None, k: int
                   ) -> tuple[float, list[float] | None, int, dict[str, float]]:
        """The prompt's greedy reward, its k sampled ones (or None), the version served, and the greedy episode's
        reward parts (an environment's per-function scores; {} single-turn)."""
        grpo = self.cfg.grpo
        if self.episodes is not None:
            async with sem:
                greedy = await self._episode(row, version, 0.0)
                sampled = [await self._episode(row, version, grpo.temperature) for _ in range(k)] if k > 1 else None
            return greedy[0], [r[0] for r in sampled] if sampled else None, greedy[1], greedy[2]
        async with sem:
            greedy = await self._ingress().generate_group.remote(
                ids, 1, version, {"max_tokens": grpo.max_new_tokens, "temperature": 0.0, "logprobs": False})
            sampled = None
            if k > 1:
                sampled = await self._ingress().generate_group.remote(
                    ids, k, version, {"max_tokens": grpo.max_new_tokens, "temperature": grpo.temperature,
                                      "top_p": grpo.top_p, "logprobs": False})
        score = lambda c: float(self.scorer(c["text"], row, c.get("finish_reason")))  # noqa: E731
        return score(greedy[0]), [score(c) for c in sampled] if sampled else None, int(greedy[0]["version"]), {}

    async def _episode(self, row: dict, version: int | None, temperature: float
                       ) -> tuple[float, int, dict[str, float]]:
        """One episode's reward, version and reward parts; an environment failure scores 0 (counted, no parts).
        An episode outlives many training steps: when its version leaves the live window mid-episode (gone), it
        is played again under the newest one."""
        from app.envs import EnvError
        from common.faults import is_gone

        sampling = {"temperature": temperature, "top_p": self.cfg.grpo.top_p if temperature else 1.0,
                    "logprobs": False}
        for attempt in range(EPISODE_ATTEMPTS):
            if version is None or attempt:
                version = await self._ingress().pin_version.remote()

            async def generate(ids, max_tokens, replica, pinned=version):
                out = await self._ingress().generate_group.remote(
                    ids, 1, pinned, dict(sampling, max_tokens=max_tokens), drop_if_expired=True, replica=replica)
                return dict(out[0], logprobs=[0.0] * len(out[0]["token_ids"]))

            try:
                ep = await self.episodes.play(row, generate)
                return self.episodes.reward(ep, row), int(ep.version), dict(ep.stats.rewards)
            except EnvError:
                self.env_errors += 1
                return 0.0, int(version), {}
            except Exception as e:
                if not is_gone(e) or attempt == EPISODE_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    async def run(self, version: int | None = None, step: int = 0) -> dict:
        """Score the eval prompts under one version (see pick_version); returns eval/* metrics plus
        eval/version (what was served) and eval/step (the step it belongs to)."""
        t0 = time.perf_counter()
        registry = self._registry()
        if registry is not None:  # held: versions may turn over many times while the eval runs
            pinned = await registry.hold.remote(version, HOLDER, EVAL_HOLD_S)
        else:
            pinned = pick_version(list(await self._ingress().live_versions.remote()), version)
        if pinned is None:  # nothing live (the base model, before step 1): pinned too, or each request would
            pinned = await self._ingress().pin_version.remote()  # take whatever version is newest when it runs
        k = self.cfg.eval.pass_k
        sem = asyncio.Semaphore(eval_concurrency(self.cfg))
        try:
            res = await asyncio.gather(*(self._one(sem, ids, row, pinned, k)
                                         for ids, row in zip(self.prompts, self.rows)))
        finally:
            if registry is not None:
                await registry.release.remote(pinned, HOLDER)
        out = score_eval([r[0] for r in res], [r[1] for r in res] if k > 1 else None, k)
        served = {r[2] for r in res}
        out.update({"eval/version": max(served), "eval/step": int(step), "eval/seconds": time.perf_counter() - t0})
        if self.episodes is not None:
            out["eval/env_errors"] = self.env_errors
        out.update(reward_parts([r[3] for r in res]))
        return out


def evaluate_service(cfg: Config, rows: list[dict], payload=None, verbose: bool = False) -> dict:
    """Start the service (the adapter published first, as `app serve` does), score once, tear down."""
    from pathlib import Path

    from ray import serve

    from app.console import Console
    from common.placement import on_driver_node
    from common.ray_utils import init_ray, kill_actor
    from common.registry import get_or_create_registry
    from serve_deployments.app_builder import start_with_adapter, wait_healthy

    cfg = cfg.replace(model={"path": str(Path(cfg.model.path).resolve())})
    started = not ray.is_initialized()
    console = Console(None, verbose)
    init_ray(cfg, verbose=verbose)
    console.adopt_ray_loggers()
    registry = get_or_create_registry(**on_driver_node())
    evaluator = None
    try:
        handle, version = start_with_adapter(cfg, registry, payload)
        wait_healthy(handle)
        evaluator = Evaluator.remote(cfg.to_dict(), rows)
        return ray.get(evaluator.run.remote(version, 0))
    finally:
        if evaluator is not None:
            kill_actor(evaluator)
        try:
            serve.delete(cfg.rollout.app_name)
        except Exception:
            pass
        kill_actor(registry)
        if started:
            ray.shutdown()
        console.close()
