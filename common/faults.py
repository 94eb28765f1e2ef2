"""The fault policy: what counts as a lost process, and how a call that lost one is retried.

One rule for the registry, the ingress and the rollout worker alike:
- A call failed because its callee is **lost** when the actor or replica behind it died, could not be
  scheduled, or Serve had none to offer (`is_lost`). A callee that *refused* the call (an error it raised
  on purpose, carrying an HTTP-like `status_code`) is not lost, and is never retried.
- An error raised by our own code because something *below* it was lost (the ingress rolling back an
  adapter load after a replica died) says so by deriving from `LostError`; `is_lost` follows that
  through Ray's wrapping (`RayTaskError.cause`) and Python's (`__cause__`), never by matching text.
- A callee that answers **gone** (410: the version the call pinned is no longer served, `is_gone`) is not
  retried under that version either; a rollout starts over under the newest one.
- A lost call is retried by its caller under one `RetryPolicy` (bounded attempts, exponential backoff,
  a deadline); each layer retries only what the layer below it could not absorb:

      replica dies mid-sample   -> the ingress retries that sample     (REPLICA_CALL)
      ingress dies mid-group    -> the rollout worker retries the group (ROLLOUT_GROUP)
      replica dies mid-publish  -> the registry retries the load        (ADAPTER_LOAD)

See docs/ARCHITECTURE.md, "Faults".
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


class LostError(RuntimeError):
    """Raised by this project's code when a call failed because a process below it was lost."""


def _lost_types() -> tuple[type, ...]:
    import ray.exceptions as rex
    from ray.serve import exceptions as sex

    return (rex.RayActorError, rex.ActorUnschedulableError, rex.ActorUnavailableError,
            sex.ReplicaUnavailableError, sex.DeploymentUnavailableError, LostError)


def _chain(e: BaseException | None):
    """The error and what it wraps: Ray's `cause` (RayTaskError) and Python's `__cause__`."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = getattr(e, "cause", None) or e.__cause__


def is_lost(e: BaseException) -> bool:
    """True when `e` says the callee (replica, ingress, actor) died or went away, False when the callee
    refused on purpose (an error with an int `status_code`) or failed for any other reason."""
    lost = _lost_types()
    for err in _chain(e):
        if isinstance(getattr(err, "status_code", None), int):
            return False
        if isinstance(err, lost):
            return True
    return False


def is_gone(e: BaseException) -> bool:
    """True when the callee refused because the version the call pinned is no longer served there (HTTP 410
    Gone): it expired from the live window, or merged weights of a newer version replaced it. Such a call
    cannot succeed under its version anywhere; the caller starts over under the newest one."""
    return any(getattr(err, "status_code", None) == 410 for err in _chain(e))


def short_error(e: BaseException) -> str:
    """The callee's own last error line, not Ray's wrapped traceback (for logs and error messages)."""
    cause = getattr(e, "cause", None) or e
    lines = [ln for ln in str(cause).strip().splitlines() if ln.strip()]
    return f"{type(cause).__name__}: {lines[-1][:300] if lines else ''}"


@dataclass(frozen=True)
class RetryPolicy:
    """Retry a lost call: at most `attempts` tries in all, `backoff_s * 2**k` apart (capped at
    `max_backoff_s`), none started after `deadline_s` from the first."""

    attempts: int
    backoff_s: float
    max_backoff_s: float
    deadline_s: float

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number `retry` (0-based)."""
        return min(self.backoff_s * 2 ** retry, self.max_backoff_s)

    async def run(self, call: Callable[[], Awaitable[T]], *,
                  on_retry: Callable[[int, BaseException], Awaitable[None] | None] | None = None,
                  retryable: Callable[[BaseException], bool] = is_lost) -> T:
        """`await call()`, retried while it fails with a `retryable` error and attempts and time are left;
        `on_retry(k, error)` runs before retry k (1-based): count it, log it, take a fresh handle."""
        deadline = time.monotonic() + self.deadline_s
        for attempt in range(self.attempts):
            try:
                return await call()
            except Exception as e:
                left = deadline - time.monotonic()
                if not retryable(e) or attempt == self.attempts - 1 or left <= 0:
                    raise
                if on_retry is not None:
                    pending = on_retry(attempt + 1, e)
                    if asyncio.iscoroutine(pending):
                        await pending
                await asyncio.sleep(min(self.delay(attempt), left))
        raise AssertionError("unreachable: attempts >= 1")


# The ingress, one sample whose replica died: the handle routes the retry to a live replica, and the
# version stays pinned (a replica lacking it loads it from the registry first).
REPLICA_CALL = RetryPolicy(attempts=5, backoff_s=0.5, max_backoff_s=4.0, deadline_s=180.0)
# The rollout worker, one group whose ingress died (or whose sample retries ran out): the whole group
# again through a fresh app handle; no sample of a failed attempt is kept.
ROLLOUT_GROUP = RetryPolicy(attempts=4, backoff_s=1.0, max_backoff_s=8.0, deadline_s=300.0)
# The registry, one version load that a dying replica or ingress failed (rolled back everywhere): again
# through a fresh handle until Serve has replaced or dropped the lost process.
ADAPTER_LOAD = RetryPolicy(attempts=60, backoff_s=2.0, max_backoff_s=10.0, deadline_s=180.0)
