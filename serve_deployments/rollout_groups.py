"""The rollout workers' side of the ingress: `generate_group`, n samples of one prompt.

- The group is pinned to one exact version (None = the newest live one; the base weights' version while
  none is live) before any sample starts, and every sample runs under it.
- The n samples are one call (`generate_n`), routed by the prompt's key and counted as n sequences of
  the replica's load: they run on one replica and share its prefix cache, and a group pays Serve's
  dispatch once, not n times (on 2 cores that was a third of the ingress's and replica's CPU per group).
- A group whose replica is lost (`common.faults.is_lost`: SIGKILL, OOM, node loss) is sent again through
  the handle, which routes it to a live replica, under `REPLICA_CALL` (bounded attempts, backoff, a
  deadline; a replica lacking the pinned version loads it from the registry first). An error a replica
  raised on purpose (a `status_code`: bad request, version expired) is raised at once.
- `drop_if_expired`: the group fails with VersionExpiredError as soon as its version expires, and at once
  when it names a version already trimmed from the live window (a later turn of a long episode).
- `partial` ("at_limit" | "all", rollout.partial): each sample may move to a newer version of the run while
  it generates (partial_rollouts.py; `partial_limit`, the run's sync.max_staleness, says when at_limit moves
  one); the group still pins its starting version, and one already trimmed
  from the live window (a later turn of a long episode), unloaded, or not live yet (a turn that moved to a
  version a replica loaded before the registry marked it live) starts under the newest live one instead of
  failing.
- The samples count against the in-flight limit but are never refused by it (admission.py).
- On a fleet, `run` names the attached run whose versions the group uses, and groups are admitted by
  weighted fair queuing between the runs (fair_queue.py) before any sample starts.
See docs/ARCHITECTURE.md, "Path of a sample" and "Faults".
"""
from __future__ import annotations

import logging

from common.faults import REPLICA_CALL, RetryPolicy, short_error
from serve_deployments.admission import Admission
from serve_deployments.fair_queue import FairQueue
from serve_deployments.openai_api import ModelNameError, resolve_version, served_name
from serve_deployments.replica import VersionExpiredError
from serve_deployments.replica_pool import ReplicaPool
from serve_deployments.served_versions import RunVersions, UnknownRunError

logger = logging.getLogger("ray.serve")


class RolloutGroups:
    def __init__(self, pool: ReplicaPool, runs: RunVersions, admission: Admission,
                 retry: RetryPolicy = REPLICA_CALL, fair: FairQueue | None = None):
        self._pool = pool
        self._runs = RunVersions.of(runs)
        self._admission = admission
        self._retry = retry
        self._fair = fair  # a fleet's fair queue; None: groups start at once (a standalone run)

    def _run(self, run: str):
        try:
            return self._runs.get(run)
        except UnknownRunError as e:
            raise ValueError(e.message) from None

    async def pin_version(self, run: str = "") -> int:
        """The version `generate_group(version=None)` would pin now: an episode pins it once for all its
        turns."""
        versions = self._run(run)
        return resolve_version(None, await versions.live(), versions.merged_version, run)

    async def generate_group(self, prompt_token_ids: list[int], n: int, version: int | None = None,
                             sampling: dict | None = None, drop_if_expired: bool = False,
                             replica: str | None = None, run: str = "", partial: str | None = None,
                             partial_limit: int | None = None) -> list[dict]:
        """n samples of one prompt (module docstring). Each result names its version, the sha256 of the
        adapter that produced it, its replica and the prompt tokens the engine found cached. `replica`:
        a multi-turn episode's session, the replica that served its previous turn (its KV cache holds the
        conversation so far); the samples go there while it is alive. Raises ValueError for a bad prompt,
        n or version."""
        if n < 1:
            raise ValueError(f"generate_group: n must be >= 1, got {n}")
        ids = [int(t) for t in prompt_token_ids]
        limit = (await self._pool.engine_info())["max_model_len"]
        if not ids or len(ids) >= limit:
            raise ValueError(f"generate_group: prompt has {len(ids)} tokens; it must be 1..{limit - 1}")
        versions = self._run(run)
        turn = None
        if self._fair is not None:  # wait for the run's fair turn before pinning: the newest version then
            turn = await self._fair.acquire(run, n, int((sampling or {}).get("max_tokens", 16)))
        try:
            live = await versions.live()
            if partial and version is not None and version not in live and version != versions.merged_version:
                # A partial turn names the version its episode's previous turn ended under, which may be trimmed
                # since, unloaded, or not live yet: a replica moves partial samples (policy all) to a version as
                # it loads it, before the registry marks it live once every replica has. It starts under the
                # newest live one instead (its samples say so per token).
                version = None
            if drop_if_expired and version is not None and live and 0 < version < min(live):
                # Trimmed from the live window while its rollout ran (a multi-turn episode's later turn): too
                # stale to train on, so gone (410), and the worker starts the group over under the newest.
                raise VersionExpiredError(version)
            try:
                pinned = resolve_version(version, live, versions.merged_version, run)
            except ModelNameError as e:
                raise ValueError(e.message) from None
            key = await self._pool.route_key(ids, pinned, versions.merged_version, run)
            if replica is not None and key is not None:
                key = dict(key, replica=str(replica))
            req = {"prompt_token_ids": ids, "version": pinned, "sampling": dict(sampling or {}),
                   "drop_if_expired": bool(drop_if_expired)}
            if partial:
                req["partial"] = str(partial)
                if partial_limit is not None:
                    req["partial_limit"] = int(partial_limit)
            if run:
                req["run"] = run
            release = self._admission.take(n)
            try:
                out = await self._samples(req, n, key)
            finally:
                release()
        finally:
            if turn is not None:
                turn()
        if self._fair is not None:
            self._fair.record(run, sum(len(o.get("token_ids", ())) for o in out))
        return out

    async def _samples(self, req: dict, n: int, key: dict | None) -> list[dict]:
        """n samples in one call, sent again (same request, same pinned version) while its replica is lost."""
        def on_retry(retry: int, error: BaseException) -> None:
            self._admission.counts["replica_retries"] += 1
            logger.warning("generate: replica lost (%s); retry %d of %d under %s", short_error(error), retry,
                           self._retry.attempts - 1, served_name(req["version"], req.get("run", "")))

        return list(await self._retry.run(lambda: self._pool.call("generate_n", req, n, key=key, weight=n),
                                          on_retry=on_retry))
