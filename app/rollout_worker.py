"""Rollout workers: prompts -> G completions through the Serve app's ingress -> rewards -> group
advantages -> groups tagged with the policy version -> the rollout buffer.

Every group is sampled under one version, chosen when it starts (the newest live one) and pinned for
all G requests, so a rollout finishes under the version it started with even if newer ones go live.

Rewards get the data row and each completion's finish_reason (app/rewards.py), plus DAPO's overlong
penalty when grpo.dapo_overlong_buffer > 0. With grpo.dynamic_sampling, a group whose rewards are all equal
(zero advantages: no learning signal) is not put in the buffer: its slot is released, so a new group is
sampled in its place, and it is counted (`filtered_groups`, RunMetrics.log_filtered_group).

Prompts: the buffer is the one prompt source. Each slot comes with its prompt and data epoch
(`RolloutBuffer.acquire` -> `Grant`), and a group that fails goes back to the buffer with its prompt
(`release(..., requeue=True)`), to be handed out again to any worker: the data cursor is the buffer's,
and survives worker restarts and resumes (common/data_cursor.py).

Faults (docs/ARCHITECTURE.md, "Faults"; the policy is common/faults.py): a replica lost mid-group is
retried by the ingress, sample by sample, under the pinned version. If the call still fails because
something was lost (the ingress itself died, or it ran out of sample retries), the whole group is
retried through a fresh app handle (`ROLLOUT_GROUP`); when that fails too, the slot goes back to the
buffer and the prompt is sampled again later. Retries are counted (`rollout_retries`,
`rollout_failed_groups` on the metrics rows); a worker never dies of a lost replica.
Workers are restartable actors (`start_workers`): a restarted worker first calls the buffer's
`reset_worker`, which gives back the slots its previous incarnation held, so they are granted again.
"""
from __future__ import annotations

import asyncio
import logging
import time

import ray

from common.config import Config, from_dict
from common.faults import ROLLOUT_GROUP, is_gone, is_lost, short_error
from common.names import BUFFER_NAME, METRICS_NAME, REGISTRY_NAME
from common.ray_utils import named_actor
from common.run_ingress import run_namespace_of
from common.types import Group, Sample

logger = logging.getLogger("app.rollout_worker")

# Ray restarts a killed worker without limit: a fixed budget is spent by faults spread over a long run (bench
# chaos, M = 20 seed 1: the fourth SIGKILL of one worker failed the run). The watch bounds a crash that comes back
# every time instead (rollout.max_restarts in a row with no step logged).
WORKER_MAX_RESTARTS = -1
# A slot whose group failed beyond ROLLOUT_GROUP's retries waits this long before its next group: a
# service that is down is not hammered (the driver's stall watch ends a run whose service never returns).
FAILED_GROUP_PAUSE_S = 4.0
NEVER_PUBLISHED = "(never published)"  # the digest _check_served compares with for such a version


def _short_digest(sha: str | None) -> str:
    return sha if sha == NEVER_PUBLISHED else str(sha)[:12]


@ray.remote(num_cpus=0)
def _reward_task(dotted: str, completion: str, row: dict, finish_reason: str | None) -> float:
    from app.rewards import load_scorer

    return load_scorer(dotted)(completion, row, finish_reason)


@ray.remote(num_cpus=0)
class RolloutWorker:
    def __init__(self, cfg: dict, worker_id: int, buffer_name: str | None = BUFFER_NAME,
                 metrics_name: str | None = METRICS_NAME):
        """`cfg`: Config.to_dict(). The run's RolloutBuffer (slots and prompts) and RunMetrics actors are
        found by name: a handle among the arguments would pin an object in the object store that a
        restart depends on (`start_workers`). None, or no Ray: no such actor."""
        from transformers import AutoTokenizer

        from app.rewards import load_scorer

        self.cfg: Config = from_dict(cfg)
        self.worker_id = worker_id
        self.namespace = run_namespace_of(self.cfg)
        self.buffer = named_actor(buffer_name, self.namespace)
        self.metrics = named_actor(metrics_name, self.namespace)
        self.tokenizer = AutoTokenizer.from_pretrained(self.cfg.model.path)
        self.scorer = load_scorer(self.cfg.reward.fn) if self.cfg.reward.fn else None
        self.episodes = None
        if self.cfg.env.episodic:
            from app.episodes import EpisodeRollout

            self.episodes = EpisodeRollout(self.cfg, self.tokenizer, self.scorer)
        self.groups_done = 0
        self._groups_started = 0  # rollout.engine_logprobs_every counts groups as they start
        self.filtered_groups = 0  # dynamic sampling: groups dropped for all-equal rewards
        self.rollout_retries = 0  # whole-group retries after a lost ingress / replica
        self.failed_groups = 0  # groups given up after those retries (their prompts come again)
        self.version_mismatches = 0  # completions whose adapter digest was not the published one
        self._eos_ids: set[int] | None = None  # grpo.ignore_eos: where the model's own answer ends
        self._ingress = None  # DeploymentHandle of the app's ingress, taken when first needed
        self._published_sha: dict[int, str | None] = {}  # version -> the registry's digest of it
        self._mismatches_reported = False
        self._started = False
        from app.judge import judge_for

        self.judge = judge_for(self.cfg, self.tokenizer, self._ingress_handle)  # None unless reward.judge.template

    def _ingress_handle(self):
        if self._ingress is None:
            from common.run_ingress import ingress_for

            self._ingress = ingress_for(self.cfg)
        return self._ingress

    def _count(self, key: str, n: int) -> None:
        if self.metrics is not None:
            self.metrics.add_count.remote(key, n)

    # ------------------------------------------------------------------ one group

    async def _score(self, comps: list[dict], row: dict) -> list[float]:
        """Task rewards plus the overlong penalty, one per completion."""
        from app.rewards import overlong_penalty

        if self.cfg.reward.fn is None:  # the judge alone scores (reward.judge.template)
            rewards = [0.0] * len(comps)
        elif self.cfg.reward.where == "task":
            refs = [_reward_task.remote(self.cfg.reward.fn, comp["text"], row, comp.get("finish_reason"))
                    for comp in comps]
            rewards = [float(reward) for reward in await asyncio.gather(*refs)]
        else:
            rewards = [self.scorer(comp["text"], row, comp.get("finish_reason")) for comp in comps]
        rewards = await self._judged(rewards, [comp["text"] for comp in comps], row)
        grpo = self.cfg.grpo
        if grpo.dapo_overlong_buffer > 0:
            rewards = [reward + overlong_penalty(len(comp["token_ids"]), grpo.max_new_tokens,
                                                 grpo.dapo_overlong_buffer, grpo.dapo_overlong_penalty)
                       for reward, comp in zip(rewards, comps)]
        return rewards

    async def _judged(self, rewards: list[float], texts: list[str], row: dict) -> list[float]:
        """reward.fn_weight x the rule rewards + reward.judge.weight x the judge's scores (app/judge.py); the
        judging is reported to the run's metrics (judge_* on the rows)."""
        weight = self.cfg.reward.fn_weight
        if self.judge is None:
            return rewards if weight == 1.0 else [weight * reward for reward in rewards]
        scores, stats = await self.judge.score_group(row, texts)
        if self.metrics is not None:
            self.metrics.log_judge.remote(stats.to_dict())
        return [weight * reward + self.cfg.reward.judge.weight * score for reward, score in zip(rewards, scores)]

    async def rollout_one(self, row: dict) -> Group:
        import torch

        from app.data import render_prompt
        from train_loops.grpo import group_advantages

        if self.episodes is not None:
            return await self.rollout_episodes(row)
        grpo = self.cfg.grpo
        prompt_ids = render_prompt(row, self.tokenizer, self.cfg.data)
        # a row may carry its own budget (data.max_tokens_column), never beyond grpo.max_new_tokens
        max_tokens = min(grpo.max_new_tokens, row.get("max_new_tokens") or grpo.max_new_tokens)
        sampling = {"max_tokens": max_tokens, "temperature": grpo.temperature, "top_p": grpo.top_p,
                    "logprobs": self._engine_logprobs()}
        if grpo.ignore_eos:
            sampling["ignore_eos"] = True
        t0 = time.perf_counter()
        comps = await self._generate_group(prompt_ids, grpo.group_size, sampling)
        gen_s = time.perf_counter() - t0
        versions = {comp["version"] for comp in comps}
        if len(versions) != 1:  # the ingress pins one version per group; anything else is a bug upstream
            raise RuntimeError(f"group sampled under several versions {sorted(versions)}")
        await self._check_served(comps)
        if grpo.ignore_eos:
            comps = [dict(comp, text=self._reply_text(comp)) for comp in comps]
        rewards = await self._score(comps, row)
        advantages = group_advantages(torch.tensor([rewards]), scale_by_std=self.cfg.scale_advantages)[0].tolist()
        version = versions.pop()
        # trainer mode: the engine returned none, the trainer computes them (train_loops/behaviour.py)
        engine_lp = sampling["logprobs"]
        samples = [Sample(prompt_ids=list(prompt_ids), completion_ids=list(comp["token_ids"]),
                          behaviour_logprobs=list(comp["logprobs"]) if engine_lp else None, reward=reward,
                          advantage=advantage,
                          version=version, prompt_id=row["id"], group_id=f"{self.worker_id}-{self.groups_done}",
                          **partial_fields(comp))
                   for comp, reward, advantage in zip(comps, rewards, advantages)]
        return Group(samples=samples, version=group_version(samples), prompt_id=row["id"], gen_seconds=gen_s,
                     gen_tokens=sum(len(comp["token_ids"]) for comp in comps))

    async def rollout_episodes(self, row: dict) -> Group:
        """G multi-turn episodes of one row (app/episodes.py), all under the version pinned now; their
        rewards -> group advantages -> one Sample per episode, its environment tokens masked out. An
        environment failure (EnvError) fails the group: the others are cancelled."""
        import torch

        from train_loops.grpo import group_advantages

        grpo = self.cfg.grpo
        version = await ROLLOUT_GROUP.run(lambda: self._ingress_handle().pin_version.remote(),
                                          on_retry=lambda *_: setattr(self, "_ingress", None))
        sampling = {"temperature": grpo.temperature, "top_p": grpo.top_p, "logprobs": self._engine_logprobs()}
        if grpo.ignore_eos:
            sampling["ignore_eos"] = True

        async def generate(ids: list[int], max_tokens: int, replica: str | None,
                           turn_version: int | None = None) -> dict:
            # rollout.partial: a turn starts under the version the episode's previous turn ended under
            comps = await self._generate_group(ids, 1, dict(sampling, max_tokens=max_tokens),
                                               turn_version or version, replica)
            return comps[0]

        t0 = time.perf_counter()
        running = [asyncio.ensure_future(self.episodes.play(row, generate)) for _ in range(grpo.group_size)]
        try:
            episodes = await asyncio.gather(*running)
        except BaseException:  # the first failure decides; the group's other episodes stop
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            raise
        gen_s = time.perf_counter() - t0
        await self._check_served([turn for ep in episodes for turn in ep.turns])
        rewards = await self._judged([self.episodes.reward(ep, row) for ep in episodes],
                                     [ep.last_text for ep in episodes], row)
        advantages = group_advantages(torch.tensor([rewards]), scale_by_std=self.cfg.scale_advantages)[0].tolist()
        samples = [Sample(prompt_ids=ep.prompt_ids, completion_ids=ep.completion_ids, behaviour_logprobs=ep.logprobs,
                          reward=reward, advantage=advantage, version=ep.version, prompt_id=row["id"],
                          group_id=f"{self.worker_id}-{self.groups_done}", completion_mask=ep.mask,
                          episode=ep.stats.to_dict(), **ep.partial_fields())
                   for ep, reward, advantage in zip(episodes, rewards, advantages)]
        return Group(samples=samples, version=group_version(samples), prompt_id=row["id"], gen_seconds=gen_s,
                     gen_tokens=sum(ep.stats.sampled_tokens for ep in episodes))

    def _reply_text(self, comp: dict) -> str:
        """grpo.ignore_eos: what the model answered, the completion up to its first end-of-sequence token, is
        what the reward scores (the tokens after it exist only to fix the length); all tokens are trained."""
        if self._eos_ids is None:
            self._eos_ids = eos_token_ids(self.cfg.model.path, self.tokenizer)
        return text_until_eos(comp, self.tokenizer, self._eos_ids)

    def _engine_logprobs(self) -> bool:
        """Whether the group starting now asks the engine for behaviour logprobs: always in engine mode; in
        trainer mode every `rollout.engine_logprobs_every`-th group of this worker (the first included), so
        the trainer/vLLM agreement is still measured on them."""
        rollout = self.cfg.rollout
        if rollout.behaviour_logprobs == "engine":
            return True
        n, self._groups_started = self._groups_started, self._groups_started + 1
        return rollout.engine_logprobs_every > 0 and n % rollout.engine_logprobs_every == 0

    async def _generate_group(self, prompt_ids: list[int], n: int, sampling: dict, version: int | None = None,
                              replica: str | None = None) -> list[dict]:
        """The ingress's generate_group; a call that lost its ingress (or a replica the ingress could
        not replace) is retried whole through a fresh app handle (ROLLOUT_GROUP). The group's version
        is whatever the ingress pins for the attempt that succeeds (`version`: that one exactly): no
        sample of a failed attempt is kept. `replica`: an episode's session (rollout_groups.py)."""

        async def attempt() -> list[dict]:
            session = {"replica": replica} if replica is not None else {}
            if self.cfg.rollout.partial:
                # at_limit moves a sample once it is max_staleness versions behind the newest (partial_rollouts.py)
                session.update(partial=self.cfg.rollout.partial_policy, partial_limit=self.cfg.sync.max_staleness)
            return await self._ingress_handle().generate_group.remote(prompt_ids, n, version, sampling,
                                                                      drop_if_expired=True, **session)

        def fresh_handle(retry: int, error: BaseException) -> None:
            self._ingress = None
            self.rollout_retries += 1
            self._count("rollout_retries", 1)
            logger.warning("worker %s: generate_group lost its replica/ingress (%s); retry %d of %d",
                           self.worker_id, short_error(error), retry, ROLLOUT_GROUP.attempts - 1)

        return await ROLLOUT_GROUP.run(attempt, on_retry=fresh_handle)

    async def _published_digest(self, version: int) -> bool:
        """Cache the registry's digest of `version` (None for the base model, version 0; the registry keeps
        every version's, trimmed or failed); False when there is nothing to compare with (no registry here)."""
        if version in self._published_sha:
            return True
        if version == 0:
            self._published_sha[0] = None
            return True
        try:
            registry = named_actor(REGISTRY_NAME, self.namespace)
            if registry is None:
                return False
            self._published_sha[version] = await registry.digest.remote(version)
        except KeyError:  # (Ray's task error is also the cause's type) never published: a mismatch below
            self._published_sha[version] = NEVER_PUBLISHED
        except Exception:  # the registry is being restarted: nothing to compare with this time
            return False
        return True

    async def _check_served(self, comps: list[dict]) -> None:
        """Served-version proof: each completion's adapter digest must be the one the registry published
        under the version it names. Mismatches are counted (`version_mismatches` on the metrics rows,
        which must stay 0) and the group is refused: its samples would train on a wrong behaviour policy."""
        bad = []
        for comp in comps:
            # a partial rollout's every version (`version_sha256`), else the one it names
            served = comp.get("version_sha256") or {str(comp["version"]): comp.get("sha256")}
            for version, sha in ((int(v), sha) for v, sha in served.items()):
                if not await self._published_digest(version):
                    continue
                if sha != self._published_sha[version]:
                    # the cached digest may be a failed publish's, the version published again since: ask again
                    del self._published_sha[version]
                    if await self._published_digest(version) and sha != self._published_sha[version]:
                        bad.append((version, comp.get("replica_id"), sha))
        self.version_mismatches += len(bad)
        if bad or not self._mismatches_reported:  # the first report makes the 0 visible
            self._count("version_mismatches", len(bad))
            self._mismatches_reported = True
        if bad:
            version, replica, sha = bad[0]
            raise RuntimeError(f"served-version mismatch on {len(bad)} of {len(comps)} samples: replica {replica} "
                               f"answered policy-v{version} with sha256 {str(sha)[:12]}, the registry published "
                               f"{_short_digest(self._published_sha[version])}")

    # ------------------------------------------------------------------ the loops

    async def run(self) -> int:
        """`rollout.groups_per_worker` concurrent loops until the buffer grants no more slots (closed, or
        the data ran out); returns the number of groups produced. Concurrency inside one actor (asyncio)
        keeps enough groups in flight to fill the engines' batches without an actor per group."""
        if not self._started:
            # First thing of every incarnation: slots a previous (dead) one held are granted again.
            self._started = True
            await self.buffer.reset_worker.remote(self.worker_id)
            self._count("rollout_retries", 0)  # the 0 is visible on the rows
            if self.judge is not None and self.metrics is not None:
                self.metrics.log_judge.remote({})
            if self.episodes is not None:
                self._count("env_errors", 0)
        await asyncio.gather(*(self._loop() for _ in range(self.cfg.rollout.groups_per_worker)))
        return self.groups_done

    async def _loop(self) -> None:
        while True:
            grant = await self.buffer.acquire.remote(self.worker_id)
            if grant is None:
                return  # the buffer closed (training is over) or handed out every epoch of the data
            row, epoch = grant["row"], int(grant["epoch"])
            slot = {"worker_id": self.worker_id, "epoch": epoch, "prompt_id": str(row["id"])}
            try:
                group = await self.rollout_one(row)
            except Exception as error:
                from app.envs import EnvError

                if isinstance(error, EnvError):
                    # Only this group is lost: its prompt is handed out again once, then counted as used.
                    await self.buffer.release.remote(**slot, env_failed=True)
                    self._count("env_errors", 1)
                    logger.warning("worker %s: episode of row %s failed: %s", self.worker_id, row.get("id"), error)
                    continue
                if is_gone(error):
                    # Its version expired (too stale to train on before it finished) or merged weights of a
                    # newer one replaced it: the slot makes a fresh group under the newest version right
                    # away, and the prompt is handed out again.
                    await self.buffer.release.remote(**slot, requeue=True, expired=True)
                    self._count("rollout_expired_groups", 1)
                    continue
                lost = is_lost(error)
                await self.buffer.release.remote(**slot, requeue=lost)  # handed out again, to any worker
                if not lost:
                    raise
                # The service lost replicas/ingress beyond the retries: the worker carries on.
                self.failed_groups += 1
                self._count("rollout_failed_groups", 1)
                logger.warning("worker %s: group for prompt %s failed after retries (%s); slot released, "
                               "prompt requeued", self.worker_id, row.get("id"), short_error(error))
                await asyncio.sleep(FAILED_GROUP_PAUSE_S)
                continue
            group.epoch = epoch
            if self.cfg.grpo.dynamic_sampling and len(set(group.rewards)) == 1:
                # DAPO dynamic sampling: no learning signal; the freed slot makes a new group in its place
                # (the prompt counts as used: the trainer's record gets it with the next batch)
                await self.buffer.release.remote(**slot, filtered=True)
                self.filtered_groups += 1
                if self.metrics is not None:
                    self.metrics.log_filtered_group.remote(group.gen_tokens, group.gen_seconds)
                continue
            await self.buffer.put.remote(group, self.worker_id)
            self.groups_done += 1
            if self.metrics is not None:
                self.metrics.log_rollout.remote(group.gen_tokens, group.gen_seconds,
                                                sum(group.rewards) / len(group.samples), row.get("task"))


def eos_token_ids(model_path: str, tokenizer) -> set[int]:
    """The tokens that end a reply for the engine: the tokenizer's EOS and the model's generation config's
    (vLLM stops on both)."""
    ids = set()
    for value in (getattr(tokenizer, "eos_token_id", None), _generation_eos(model_path)):
        ids.update([value] if isinstance(value, int) else list(value or []))
    return ids


def text_until_eos(comp: dict, tokenizer, eos_ids: set[int]) -> str:
    """A completion's text up to its first end-of-sequence token (all of it when it has none)."""
    ids = comp["token_ids"]
    cut = next((i for i, t in enumerate(ids) if t in eos_ids), None)
    return comp["text"] if cut is None else tokenizer.decode(ids[:cut], skip_special_tokens=True)


def _generation_eos(model_path: str):
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json: the tokenizer's EOS alone
        return None


def partial_fields(comp: dict) -> dict:
    """A completion's provenance (rollout.partial) as Sample fields; {} for a request that did not run partial."""
    if "versions" not in comp:
        return {}
    return {"token_versions": [[int(v), int(n)] for v, n in comp["versions"]], "resumed": int(comp.get("resumed", 0)),
            "regenerated_tokens": int(comp.get("regenerated_tokens", 0))}


def group_version(samples: list[Sample]) -> int:
    """The version the buffer judges a group by: the one it finished under, its newest token's (the samples'
    common version when none was continued). A group is trained whole, and its short samples finish under the
    version it started with while a long one is continued: judged by their version, every group with a continued
    sample would be dropped once done, after all its work. The buffer's pacing bounds how far ahead a group
    starts; the trainer's per-token importance ratios correct its older tokens, which staleness_max reports."""
    return max(s.last_version for s in samples)


def start_workers(cfg: Config) -> list:
    """The run's rollout workers as restartable actors, sampling for the run's RolloutBuffer and
    reporting to its RunMetrics (the named actors the driver started): a worker killed mid-run (OOM,
    node loss) is restarted by Ray (`max_restarts`, no limit: the driver's watch ends a run whose worker
    restarts more than rollout.max_restarts times with no step between), its `run` call retried on the new
    incarnation (`max_task_retries`), and the new incarnation gives its predecessor's slots back to the buffer
    (`reset_worker`) before sampling, so they are granted again. The driver calls `w.run.remote()` on
    each; `ray.kill` (no_restart) still ends them at teardown. A restart rebuilds a worker from its
    constructor arguments, so they are plain values Ray keeps inline (the config, the worker id): no
    actor handle, whose serialized form refers to an object in the object store."""
    return [RolloutWorker.options(max_restarts=WORKER_MAX_RESTARTS, max_task_retries=-1).remote(
                cfg.to_dict(), worker_id)
            for worker_id in range(cfg.rollout.workers)]
