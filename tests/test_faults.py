"""The fault policy (common/faults.py): lost vs refused vs gone, through Ray's and Python's wrapping, and the
retry budget. Pure: errors are built by hand (and through a pickle round trip, as Ray sends them)."""
from __future__ import annotations

import asyncio
import pickle

import pytest
import ray.exceptions as rex

from common.faults import LostError, RetryPolicy, is_gone, is_lost
from serve_deployments.engine_weights import ReplicaError
from serve_deployments.replica import VersionExpiredError


def test_lost_refused_and_gone_are_told_apart():
    assert is_lost(rex.ActorDiedError())
    assert is_lost(LostError("a replica died during the load"))
    refused = ReplicaError("bad adapter", 422)
    assert not is_lost(refused) and not is_gone(refused)
    gone = ReplicaError("policy-v2 is no longer served", 410)
    assert is_gone(gone) and not is_lost(gone)
    expired = pickle.loads(pickle.dumps(VersionExpiredError(3)))
    assert is_gone(expired) and not is_lost(expired)


def test_wrapped_errors_keep_their_meaning():
    try:
        try:
            raise ReplicaError("policy-v2 is no longer served", 410)
        except ReplicaError as inner:
            raise RuntimeError("generate_group failed") from inner
    except RuntimeError as outer:
        assert is_gone(outer) and not is_lost(outer)
    task_error = rex.RayTaskError("generate", "traceback", VersionExpiredError(4)).as_instanceof_cause()
    assert is_gone(task_error)
    lost_inside = rex.RayTaskError("load_adapter", "traceback", LostError("replica died")).as_instanceof_cause()
    assert is_lost(lost_inside)


def test_retry_policy_retries_lost_calls_only_and_stops_at_its_budget():
    policy = RetryPolicy(attempts=3, backoff_s=0.0, max_backoff_s=0.0, deadline_s=10.0)
    calls, retries = [], []

    async def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise LostError("replica died")
        return "ok"

    assert asyncio.run(policy.run(flaky, on_retry=lambda k, e: retries.append(k))) == "ok"
    assert retries == [1, 2]

    async def always_lost():
        raise LostError("replica died")

    with pytest.raises(LostError):
        asyncio.run(policy.run(always_lost))

    refusals = []

    async def refused():
        refusals.append(1)
        raise ReplicaError("bad", 422)

    with pytest.raises(ReplicaError):
        asyncio.run(policy.run(refused))
    assert refusals == [1]
    assert RetryPolicy(attempts=5, backoff_s=0.5, max_backoff_s=4.0, deadline_s=1).delay(4) == 4.0
