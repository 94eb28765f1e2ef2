"""Rollout workers: prompts -> G completions through the router -> rewards -> group advantages ->
groups tagged with the policy version -> the rollout buffer.

Every group is sampled under one version, chosen when it starts (the newest live one) and pinned for
all G requests, so a rollout finishes under the version it started with even if newer ones go live.

Rewards get the data row and each completion's finish_reason (app/rewards.py), plus DAPO's overlong
penalty when grpo.dapo_overlong_buffer > 0. With grpo.dynamic_sampling, a group whose rewards are all equal
(zero advantages: no learning signal) is not put in the buffer: its slot is released, so a new group is
sampled in its place, and it is counted (`filtered_groups`, RunMetrics.log_filtered_group).
"""
from __future__ import annotations

import asyncio
import time

import ray

from common.config import Config, from_dict
from common.types import Group, Sample


@ray.remote(num_cpus=0)
def _reward_task(dotted: str, completion: str, row: dict, finish_reason: str | None) -> float:
    from app.rewards import load_scorer

    return load_scorer(dotted)(completion, row, finish_reason)


@ray.remote(num_cpus=0)
class RolloutWorker:
    def __init__(self, cfg: dict, worker_id: int, rows: list[dict], buffer, metrics=None):
        from transformers import AutoTokenizer

        from app.data import Cursor, PromptStream
        from app.rewards import load_scorer

        self.cfg: Config = from_dict(cfg)
        self.worker_id = worker_id
        self.buffer, self.metrics = buffer, metrics
        self.tokenizer = AutoTokenizer.from_pretrained(self.cfg.model.path)
        self.scorer = load_scorer(self.cfg.reward.fn)
        d = self.cfg.data
        # Workers take disjoint strides of one seeded order, so no prompt is sampled twice per epoch.
        self.stream = PromptStream(rows[worker_id::self.cfg.rollout.workers], d.shuffle_seed + worker_id, d.epochs,
                                   Cursor())
        self._stop = False
        self.groups_done = 0
        self.filtered_groups = 0  # dynamic sampling: groups dropped for all-equal rewards
        self._router = None

    def _router_handle(self):
        if self._router is None:
            from ray import serve

            self._router = serve.get_app_handle(self.cfg.rollout.app_name)
        return self._router

    async def _score(self, comps: list[dict], row: dict) -> list[float]:
        """Task rewards plus the overlong penalty, one per completion."""
        from app.rewards import overlong_penalty

        if self.cfg.reward.where == "task":
            refs = [_reward_task.remote(self.cfg.reward.fn, c["text"], row, c.get("finish_reason")) for c in comps]
            rewards = [float(r) for r in await asyncio.gather(*refs)]
        else:
            rewards = [self.scorer(c["text"], row, c.get("finish_reason")) for c in comps]
        g = self.cfg.grpo
        if g.dapo_overlong_buffer > 0:
            rewards = [r + overlong_penalty(len(c["token_ids"]), g.max_new_tokens, g.dapo_overlong_buffer,
                                            g.dapo_overlong_penalty) for r, c in zip(rewards, comps)]
        return rewards

    async def rollout_one(self, row: dict) -> Group:
        from app.data import render_prompt
        from train_loops.grpo import group_advantages

        import torch

        g = self.cfg.grpo
        prompt_ids = render_prompt(row, self.tokenizer, self.cfg.data)
        sampling = {"max_tokens": g.max_new_tokens, "temperature": g.temperature, "top_p": g.top_p, "logprobs": True}
        t0 = time.perf_counter()
        comps = await self._router_handle().generate_group.remote(prompt_ids, g.group_size, None, sampling)
        gen_s = time.perf_counter() - t0
        versions = {c["version"] for c in comps}
        if len(versions) != 1:  # the router pins one version per group; anything else is a bug upstream
            raise RuntimeError(f"group sampled under several versions {sorted(versions)}")
        await self._check_served(comps)
        rewards = await self._score(comps, row)
        adv = group_advantages(torch.tensor([rewards]), scale_by_std=self.cfg.scale_advantages)[0].tolist()
        version = versions.pop()
        samples = [Sample(prompt_ids=list(prompt_ids), completion_ids=list(c["token_ids"]),
                          behaviour_logprobs=list(c["logprobs"]), reward=r, advantage=a, version=version,
                          prompt_id=row["id"], group_id=f"{self.worker_id}-{self.groups_done}")
                   for c, r, a in zip(comps, rewards, adv)]
        return Group(samples=samples, version=version, prompt_id=row["id"], gen_seconds=gen_s,
                     gen_tokens=sum(len(c["token_ids"]) for c in comps))

    async def _check_served(self, comps: list[dict]) -> None:
        """Served-version proof: each completion's adapter digest must be the one the registry published
        under the version it names (fetched once per version; None for the original base model).
        Mismatches are counted (`version_mismatches` on the metrics rows, which must stay 0) and the
        group is refused: its samples would train on a wrong behaviour policy."""
        from app.registry import get_registry

        cache = self.__dict__.setdefault("_published_sha", {})
        first = not hasattr(self, "version_mismatches")
        self.version_mismatches = getattr(self, "version_mismatches", 0)
        bad = []
        for c in comps:
            v = int(c["version"])
            if v not in cache:
                try:
                    cache[v] = (await get_registry().get.remote(v))["meta"].get("sha256") if v > 0 else None
                except Exception:  # trimmed from the registry already (or none here): nothing to compare with
                    continue
            if c.get("sha256") != cache[v]:
                bad.append((v, c.get("replica_id"), c.get("sha256")))
        self.version_mismatches += len(bad)
        report = getattr(self.metrics, "add_count", None)
        if report is not None and (bad or first):
            report.remote("version_mismatches", len(bad))  # the first call makes the 0 visible
        if bad:
            v, rid, sha = bad[0]
            raise RuntimeError(f"served-version mismatch on {len(bad)} of {len(comps)} samples: replica {rid} "
                               f"answered policy-v{v} with sha256 {str(sha)[:12]}, the registry published "
                               f"{str(cache.get(v))[:12]}")

    async def run(self) -> int:
        """`rollout.groups_per_worker` concurrent loops until stopped or the data runs out; returns the
        number of groups produced. Concurrency inside one actor (asyncio) keeps enough groups in flight
        to fill the engines' batches without an actor per group."""
        import asyncio

        await asyncio.gather(*(self._loop() for _ in range(self.cfg.rollout.groups_per_worker)))
        return self.groups_done

    async def _loop(self) -> None:
        while not self._stop:
            if not await self.buffer.acquire.remote():
                break  # buffer closed: training is over
            try:
                row = next(self.stream)
            except StopIteration:
                await self.buffer.release.remote()
                break
            try:
                group = await self.rollout_one(row)
            except Exception:
                await self.buffer.release.remote()
                raise
            if self.cfg.grpo.dynamic_sampling and len(set(group.rewards)) == 1:
                # DAPO dynamic sampling: no learning signal; the freed slot makes a new group in its place
                await self.buffer.release.remote()
                self.filtered_groups += 1
                if self.metrics is not None:
                    self.metrics.log_filtered_group.remote(group.gen_tokens, group.gen_seconds)
                continue
            await self.buffer.put.remote(group)
            self.groups_done += 1
            if self.metrics is not None:
                self.metrics.log_rollout.remote(group.gen_tokens, group.gen_seconds, sum(group.rewards) / len(group.samples))

    def stop(self) -> None:
        self._stop = True

    def cursor(self) -> dict:
        return {"epoch": self.stream.cursor.epoch, "index": self.stream.cursor.index}
