"""Rollout workers: prompts -> G completions through the router -> rewards -> group advantages ->
groups tagged with the policy version -> the rollout buffer.

Every group is sampled under one version, chosen when it starts (the newest live one) and pinned for
all G requests, so a rollout finishes under the version it started with even if newer ones go live.

Rewards get the data row and each completion's finish_reason (app/rewards.py), plus DAPO's overlong
penalty when grpo.dapo_overlong_buffer > 0. With grpo.dynamic_sampling, a group whose rewards are all equal
(zero advantages: no learning signal) is not put in the buffer: its slot is released, so a new group is
sampled in its place, and it is counted (`filtered_groups`, RunMetrics.log_filtered_group).

Faults: a replica lost mid-group is retried by the router ingress, sample by sample, under the pinned
version. If the call still fails with a lost-actor error (the ingress itself died, or the router ran out
of retries), the whole group is retried through a fresh app handle (bounded, with backoff); when that
fails too, the slot goes back to the buffer and the prompt is sampled again later. Retries are counted
(`rollout_retries`, `rollout_failed_groups` on the metrics rows); a worker never dies of a lost replica.
Workers are restartable actors (`start_workers`): a restarted worker first calls the buffer's
`reset_worker`, which gives back the slots its previous incarnation held, so they are granted again.

Prompts: when the buffer holds the data (the driver's runs), each slot comes with its prompt and data
epoch (`acquire` -> `{"epoch", "row"}`), and a group that fails goes back to the buffer with its prompt
(`release(..., requeue=True)`), to be handed out again to any worker: the data cursor is the buffer's,
and survives worker restarts and resumes (common/data_cursor.py). Without it (tests' fake buffers) each
worker walks its own stride of the data, as before.
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


GROUP_RETRY_ATTEMPTS = 4  # whole-group attempts through a fresh handle when the ingress is lost
GROUP_RETRY_BACKOFF_S = 1.0  # doubled per attempt, capped at 8 s
GROUP_RETRY_DEADLINE_S = 300.0
WORKER_MAX_RESTARTS = 3


def _expired(e: BaseException) -> bool:
    """The group's version expired while it was generated (serve_deployments.replica.VersionExpiredError):
    its samples would be dropped as stale, so the group is given up, not retried under that version."""
    from serve_deployments.replica import VersionExpiredError

    while e is not None:
        if isinstance(e, VersionExpiredError) or "VersionExpiredError" in type(e).__name__:
            return True
        e = getattr(e, "cause", None) or e.__cause__
    return False


def _lost(e: BaseException) -> bool:
    """A lost replica / ingress (actor death, unavailable replica), as opposed to an error raised on purpose."""
    from serve_deployments.ingress import _replica_lost

    return _replica_lost(e)


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
        self.rollout_retries = 0  # whole-group retries after a lost ingress / replica
        self.failed_groups = 0  # groups given up after those retries (their prompts come again)
        self._router = None
        self._retry_rows: list[dict] = []  # prompts whose group failed: sampled again first
        self._started = False

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
        import torch

        from app.data import render_prompt
        from train_loops.grpo import group_advantages

        g = self.cfg.grpo
        prompt_ids = render_prompt(row, self.tokenizer, self.cfg.data)
        sampling = {"max_tokens": g.max_new_tokens, "temperature": g.temperature, "top_p": g.top_p, "logprobs": True}
        if g.ignore_eos:
            sampling["ignore_eos"] = True
        t0 = time.perf_counter()
        comps = await self._generate_group(prompt_ids, g.group_size, sampling)
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

    async def _generate_group(self, prompt_ids: list[int], n: int, sampling: dict) -> list[dict]:
        """The router's generate_group; on a lost ingress (or a replica loss the router could not absorb)
        the whole group again through a fresh app handle, bounded. The group's version is whatever the
        router pins for the attempt that succeeds: no sample of a failed attempt is kept."""
        import logging

        deadline = time.monotonic() + GROUP_RETRY_DEADLINE_S
        for attempt in range(GROUP_RETRY_ATTEMPTS):
            try:
                return await self._router_handle().generate_group.remote(prompt_ids, n, None, sampling,
                                                                         drop_if_expired=True)
            except Exception as e:
                left = deadline - time.monotonic()
                if not _lost(e) or attempt == GROUP_RETRY_ATTEMPTS - 1 or left <= 0:
                    raise
                self._router = None  # a fresh handle next time
                self.rollout_retries = getattr(self, "rollout_retries", 0) + 1
                self._count("rollout_retries", 1)
                logging.getLogger("app.rollout_worker").warning(
                    "worker %s: generate_group lost its replica/ingress (%s: %s); retry %d of %d",
                    self.worker_id, type(e).__name__, (str(e).strip().splitlines() or [""])[-1][:200],
                    attempt + 1, GROUP_RETRY_ATTEMPTS - 1)
                await asyncio.sleep(min(GROUP_RETRY_BACKOFF_S * 2 ** attempt, 8.0, left))
        raise AssertionError("unreachable")

    def _count(self, key: str, n: int) -> None:
        report = getattr(self.metrics, "add_count", None)
        if report is not None:
            report.remote(key, n)

    async def _check_served(self, comps: list[dict]) -> None:
        """Served-version proof: each completion's adapter digest must be the one the registry published
        under the version it names (fetched once per version; None for the original base model).
        Mismatches are counted (`version_mismatches` on the metrics rows, which must stay 0) and the
        group is refused: its samples would train on a wrong behaviour policy."""
        from common.registry import get_registry

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

        if self._tracked() and not getattr(self, "_started", False):
            # First thing of every incarnation: slots a previous (dead) one held are granted again.
            self._started = True
            await self.buffer.reset_worker.remote(self.worker_id)
            self._count("rollout_retries", 0)  # the 0 is visible on the rows
        await asyncio.gather(*(self._loop() for _ in range(self.cfg.rollout.groups_per_worker)))
        return self.groups_done

    def _tracked(self) -> bool:
        """Whether the buffer tracks slots per worker (the RolloutBuffer actor does)."""
        try:
            return hasattr(self.buffer, "reset_worker")
        except Exception:
            return False

    def _slot_kw(self) -> dict:
        return {"worker_id": self.worker_id} if self._tracked() else {}

    def _next_row(self) -> dict:
        retry = self.__dict__.setdefault("_retry_rows", [])
        return retry.pop(0) if retry else next(self.stream)

    async def _loop(self) -> None:
        kw = self._slot_kw()
        while not self._stop:
            grant = await self.buffer.acquire.remote(**kw)
            if not grant:
                break  # buffer closed (training is over) or, when it hands out prompts, the data ran out
            if isinstance(grant, dict):  # the buffer is the prompt source (common/data_cursor.py)
                row, epoch = grant["row"], int(grant["epoch"])
                pkw = {**kw, "epoch": epoch, "prompt_id": str(row["id"])}
            else:
                try:
                    row = self._next_row()
                except StopIteration:
                    await self.buffer.release.remote(**kw)
                    break
                epoch, pkw = getattr(getattr(self.stream, "cursor", None), "epoch", 0), None
            try:
                group = await self.rollout_one(row)
                group.epoch = epoch
            except Exception as e:
                if _expired(e):
                    # Too stale to train on before it finished: the slot makes a fresh group under the
                    # newest version right away, and the prompt is handed out again.
                    if pkw is not None:
                        await self.buffer.release.remote(**pkw, requeue=True, expired=True)
                    else:
                        self._retry_rows.append(row)
                        await self.buffer.release.remote(**kw, expired=True)
                    self._count("rollout_expired_groups", 1)
                    continue
                if pkw is not None:  # the buffer hands the prompt out again (to any worker)
                    await self.buffer.release.remote(**pkw, requeue=_lost(e))
                else:
                    await self.buffer.release.remote(**kw)
                if not _lost(e):
                    raise
                # The service lost replicas/ingress beyond the retries: the slot is given back and the
                # prompt sampled again later; the worker carries on (the driver's stall watch ends a
                # run whose service never comes back).
                import logging

                if pkw is None:
                    self._retry_rows.append(row)
                self.failed_groups = getattr(self, "failed_groups", 0) + 1
                self._count("rollout_failed_groups", 1)
                logging.getLogger("app.rollout_worker").warning(
                    "worker %s: group for prompt %s failed after retries (%s); slot released, prompt requeued",
                    self.worker_id, row.get("id"), type(e).__name__)
                await asyncio.sleep(GROUP_RETRY_BACKOFF_S * 4)
                continue
            if self.cfg.grpo.dynamic_sampling and len(set(group.rewards)) == 1:
                # DAPO dynamic sampling: no learning signal; the freed slot makes a new group in its place
                # (the prompt counts as used: the trainer's record gets it with the next batch)
                await self.buffer.release.remote(**(pkw or kw), **({"filtered": True} if pkw else {}))
                self.filtered_groups += 1
                if self.metrics is not None:
                    self.metrics.log_filtered_group.remote(group.gen_tokens, group.gen_seconds)
                continue
            await self.buffer.put.remote(group, **kw)
            self.groups_done += 1
            if self.metrics is not None:
                self.metrics.log_rollout.remote(group.gen_tokens, group.gen_seconds,
                                                sum(group.rewards) / len(group.samples))

    def stop(self) -> None:
        self._stop = True

    def cursor(self) -> dict:
        return {"epoch": self.stream.cursor.epoch, "index": self.stream.cursor.index}


def start_workers(cfg: Config, rows: list[dict], buffer, metrics=None) -> list:
    """The run's rollout workers as restartable actors: a worker killed mid-run (OOM, node loss) is
    restarted by Ray (`max_restarts`), its `run` call retried on the new incarnation
    (`max_task_retries`), and the new incarnation gives its predecessor's slots back to the buffer
    (`reset_worker`) before sampling, so they are granted again. The driver calls `w.run.remote()` on
    each, as before; `ray.kill` (no_restart) still ends them at teardown."""
    return [RolloutWorker.options(max_restarts=WORKER_MAX_RESTARTS, max_task_retries=-1).remote(
                cfg.to_dict(), i, rows, buffer, metrics)
            for i in range(cfg.rollout.workers)]
