"""FleetState: a fleet's control plane, one detached named actor beside its Serve app (docs/FLEET.md).

It owns what must outlive any one request or run: the fleet's capacity (the engines' adapter slots and
`max_lora_rank`), the digests of its admin and read tokens, and the attached runs, each with its slot quota,
fair-share weight, LoRA rank, token digest and lease. The ingress asks it who may do what (cached there for a
few seconds); the replicas ask it which runs to load at start.

- `attach` (admin token) checks the run's name, rank and slots against what is left, at once: a run that does
  not fit is refused with the numbers (FleetError 409), never queued here (`app train --wait` retries). It tells
  the ingress (`attach_run`: quota broadcast to every replica, weight into the fair queue) and returns the run's
  own token, shown once.
- `renew` (the run's token) extends the lease; the driver renews every `lease_s / 4`.
- A run that detaches, or whose lease ran out (its driver was killed, or lost its node), is forgotten: the
  ingress unloads its adapters on every replica and frees its slots (`forget_run`). The reaper checks every
  second, so a dead run is gone within `lease_s` + one broadcast.
Tokens are compared by SHA-256 digest in constant time; only digests are kept.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import math
import secrets
import time

import ray

from common.types import check_run_name

logger = logging.getLogger("ray.serve")

DEFAULT_LEASE_S = 30.0
REAP_EVERY_S = 1.0


class FleetError(RuntimeError):
    """A fleet request refused, with the HTTP status it maps to (401/403 token, 404 no such run, 409 does not
    fit or name taken, 400 bad request)."""

    def __init__(self, message: str, status_code: int = 400):
        super().__init__(message)
        self.status_code = status_code

    def __reduce__(self):  # keep status_code when Ray pickles it to the caller
        return (type(self), (str(self), self.status_code))


def digest(token: str | None) -> str | None:
    return hashlib.sha256(token.encode()).hexdigest() if token else None


def same(token: str | None, sha: str | None) -> bool:
    return bool(token and sha) and hmac.compare_digest(digest(token), sha)


def new_token() -> str:
    return secrets.token_urlsafe(24)


@ray.remote(num_cpus=0)
class FleetState:
    def __init__(self, fleet: str, app_name: str, capacity: int, max_lora_rank: int, admin_sha: str,
                 read_sha: str | None = None, lease_s: float = DEFAULT_LEASE_S, info: dict | None = None):
        if capacity < 1 or max_lora_rank < 1 or lease_s <= 0:
            raise ValueError(f"fleet {fleet}: capacity {capacity}, max_lora_rank {max_lora_rank} and lease_s "
                             f"{lease_s} must be positive")
        self.fleet, self.app_name = fleet, app_name
        self.capacity, self.max_lora_rank, self.lease_s = int(capacity), int(max_lora_rank), float(lease_s)
        self._admin_sha, self._read_sha = admin_sha, read_sha
        self.info = dict(info or {})  # model, replicas, http_port: what `fleet status` shows
        self._runs: dict[str, dict] = {}
        self._ingress = None
        self._reaper: asyncio.Task | None = None
        self.forgotten: list[dict] = []  # the last runs that left, with why (status)
        self._cards: dict[str, asyncio.Task] = {}  # run -> its card's deployment (run_card.py)

    # ------------------------------------------------------------------ tokens

    async def check_admin(self, token: str | None) -> bool:
        return same(token, self._admin_sha)

    async def check_read(self, token: str | None) -> bool:
        """May this token read (REST completions of any run, /v1/models)? Always, with no read token set; the
        admin token and every run's token read too."""
        if self._read_sha is None or same(token, self._read_sha) or same(token, self._admin_sha):
            return True
        return any(same(token, r["token_sha"]) for r in self._runs.values())

    async def authorize(self, run: str, token: str | None) -> bool:
        """May `token` change `run`'s adapters? Its own token, or the fleet's admin token."""
        self._start_reaper()
        r = self._runs.get(run)
        return same(token, self._admin_sha) or (r is not None and same(token, r["token_sha"]))

    async def is_run_token(self, token: str | None) -> bool:
        return any(same(token, r["token_sha"]) for r in self._runs.values())

    # ------------------------------------------------------------------ runs

    async def attach(self, admin_token: str | None, run: str, slots: int, weight: float = 1.0,
                     lora_rank: int = 8, meta: dict | None = None) -> dict:
        """Attach `run` (module docstring). Returns {"token", "lease_s", "slots", "free"}; raises FleetError."""
        self._start_reaper()
        if not same(admin_token, self._admin_sha):
            raise FleetError(f"fleet {self.fleet}: attaching a run needs the fleet's admin token", 401)
        try:
            check_run_name(run)
        except ValueError as e:
            raise FleetError(str(e), 400) from None
        if not run:
            raise FleetError("a run attached to a fleet needs a name (run.name)", 400)
        if not (isinstance(slots, int) and slots >= 2) or not weight > 0:
            raise FleetError(f"run {run}: slots {slots} must be >= 2 and weight {weight} > 0", 400)
        if lora_rank > self.max_lora_rank:
            raise FleetError(f"run {run}: lora.rank {lora_rank} exceeds the fleet's max_lora_rank "
                             f"{self.max_lora_rank}", 409)
        self._reap()
        if run in self._runs:
            raise FleetError(f"run {run} is already attached to fleet {self.fleet} (its lease ends in "
                             f"{self._lease_left(run):.0f}s); pick another run.name", 409)
        used = self.used_slots()
        if used + slots > self.capacity:
            raise FleetError(
                f"fleet {self.fleet} is full: run {run} needs {slots} adapter slots (its live versions, one to swap in "
                f"the next, one more with eval.path), "
                f"{self.capacity - used} of {self.capacity} are free ({len(self._runs)} runs use {used}); "
                "wait for a run to finish (app train --wait) or start the fleet with more (sync.max_loras)", 409)
        token = new_token()
        self._runs[run] = {"token_sha": digest(token), "slots": slots, "weight": float(weight),
                           "lora_rank": int(lora_rank), "attached_at": time.time(),
                           "deadline": math.inf, "meta": dict(meta or {})}
        try:
            await (await self._ingress_handle()).attach_run.remote(run, slots, float(weight))
        except Exception:
            self._runs.pop(run, None)
            raise
        # The lease starts when the run learns it is attached: on a loaded head the handle lookup and the
        # ingress call took 9 s once, and a lease counted from the request ran out before the first renewal.
        self._runs[run]["deadline"] = time.monotonic() + self.lease_s
        logger.info("fleet %s: run %s attached (%d slots, weight %g, rank %d)", self.fleet, run, slots, weight,
                    lora_rank)
        self._start_card(run)
        return {"token": token, "lease_s": self.lease_s, "slots": slots, "free": self.capacity - used - slots}

    async def renew(self, run: str, token: str) -> float:
        """Extend `run`'s lease; returns its length. FleetError 404 once the run was forgotten (its lease ran
        out): the run must stop, its adapters are gone."""
        r = self._runs.get(run)
        if r is None:
            raise FleetError(f"run {run} is not attached to fleet {self.fleet} (lease expired or detached)", 404)
        if not same(token, r["token_sha"]):
            raise FleetError(f"run {run}: wrong token", 403)
        r["deadline"] = time.monotonic() + self.lease_s
        return self.lease_s

    async def detach(self, run: str, token: str, status: str = "detached") -> dict:
        if run not in self._runs:
            return {"run": run, "detached": False}
        if not (same(token, self._runs[run]["token_sha"]) or same(token, self._admin_sha)):
            raise FleetError(f"run {run}: wrong token", 403)
        return await self._forget(run, status)

    async def runs(self) -> dict:
        """{run: {"slots", "weight", "lora_rank", "attached_at", "lease_left_s", "meta"}} (no token digests)."""
        return {run: {k: v for k, v in r.items() if k not in ("token_sha", "deadline")}
                | {"lease_left_s": round(self._lease_left(run), 1)} for run, r in self._runs.items()}

    def _lease_left(self, run: str) -> float:
        """Seconds until `run` is forgotten; a whole lease while its attach is still under way."""
        return min(self._runs[run]["deadline"] - time.monotonic(), self.lease_s)

    def used_slots(self) -> int:
        return sum(r["slots"] for r in self._runs.values())

    async def describe(self) -> dict:
        return {"fleet": self.fleet, "app": self.app_name, "capacity": self.capacity, "used": self.used_slots(),
                "max_lora_rank": self.max_lora_rank, "lease_s": self.lease_s, "read_token": self._read_sha is not None,
                "runs": await self.runs(), "left": list(self.forgotten[-10:]), **self.info}

    # ------------------------------------------------------------------ run cards (the dashboard's rows)

    def _start_card(self, run: str) -> None:
        self._cards[run] = asyncio.get_running_loop().create_task(self._card(run, deploy=True))

    def _end_card(self, run: str) -> None:
        task = self._cards.pop(run, None)
        if task is not None:
            asyncio.get_running_loop().create_task(self._card(run, deploy=False, after=task))

    async def _card(self, run: str, deploy: bool, after: asyncio.Task | None = None) -> None:
        """Deploy or delete `run`'s card in a thread (Serve's calls block); a failure costs only the card."""
        from serve_deployments.run_card import delete_run_card, deploy_run_card

        if after is not None:
            await asyncio.gather(after, return_exceptions=True)  # a card still deploying is deleted after
        try:
            await asyncio.to_thread(deploy_run_card if deploy else delete_run_card, self.fleet, run)
        except Exception as e:
            logger.warning("fleet %s: %s run %s's card failed: %s", self.fleet, "deploying" if deploy else
                           "deleting", run, e)

    async def cards(self) -> list[str]:
        """Runs whose card is deployed or deploying."""
        return sorted(self._cards)

    # ------------------------------------------------------------------ leases

    async def _ingress_handle(self):
        """The fleet ingress's handle. The first lookup asks the Serve controller and blocks, so it runs in a
        thread: on the event loop it held up every run's lease renewal for seconds on a loaded head."""
        if self._ingress is None:
            from ray import serve

            self._ingress = await asyncio.to_thread(serve.get_app_handle, self.app_name)
        return self._ingress

    def _start_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())

    async def ping(self) -> bool:
        self._start_reaper()
        return True

    def _reap(self) -> list[str]:
        now = time.monotonic()
        return [run for run, r in self._runs.items() if r["deadline"] <= now]

    async def _reap_forever(self) -> None:
        while True:
            for run in self._reap():
                try:
                    await self._forget(run, "lease expired")
                except Exception as e:  # the ingress is being replaced: try again next round
                    logger.warning("fleet %s: forgetting run %s failed: %s", self.fleet, run, e)
                    self._ingress = None
            await asyncio.sleep(REAP_EVERY_S)

    async def _forget(self, run: str, status: str) -> dict:
        """Unload the run's adapters everywhere (the ingress broadcasts), then drop it: its slots are free."""
        out = await (await self._ingress_handle()).forget_run.remote(run)
        r = self._runs.pop(run, None)
        self._end_card(run)
        if r is not None:
            self.forgotten.append({"run": run, "status": status, "time": time.time()})
            logger.info("fleet %s: run %s left (%s)", self.fleet, run, status)
        return {"run": run, "detached": True, "status": status, **(out or {})}
