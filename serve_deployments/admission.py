"""The ingress's in-flight limit: REST sequences and rollout calls now at the replicas, and its counters.

The limit is `max_inflight_per_replica` x replicas. A REST request over it gets 429 with Retry-After at
once instead of queueing without bound; rollout calls are counted against it but never refused (rollout
workers pace themselves through the buffer). The counters are `stats()["admission"]`.
"""
from __future__ import annotations

from collections.abc import Callable

from serve_deployments.openai_body import APIError

RETRY_AFTER_S = 1


class Admission:
    def __init__(self, max_inflight: int):
        self.max_inflight = max(1, int(max_inflight))
        self.inflight = 0
        self.counts = {"rejected_429": 0, "rejected_413": 0, "rejected_4xx": 0, "version_mismatches": 0,
                       "replica_retries": 0}

    def full(self, weight: int = 1) -> bool:
        """True when `weight` more sequences would pass the limit."""
        return self.inflight + weight > self.max_inflight

    def overloaded(self) -> APIError:
        """The 429 a REST request over the limit gets (counted)."""
        self.counts["rejected_429"] += 1
        return APIError(429, f"server busy: {self.max_inflight} requests in flight (the limit); retry after "
                             f"{RETRY_AFTER_S}s", "rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_S)})

    def rejected(self, status: int) -> None:
        """Count a client error answered (429s are counted where they are made)."""
        if status == 413:
            self.counts["rejected_413"] += 1
        elif status != 429:
            self.counts["rejected_4xx"] += 1

    def take(self, weight: int) -> Callable[[], None]:
        """Admit `weight` sequences; returns their release, which gives them back once however often called."""
        self.inflight += weight
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.inflight -= weight

        return release

    def snapshot(self) -> dict:
        return {"inflight": self.inflight, "max_inflight": self.max_inflight, **self.counts}
