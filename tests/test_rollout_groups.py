"""The ingress's rollout front (serve_deployments/rollout_groups.py), tested apart from Serve and vLLM: a
fake replica pool answers the samples from a script (tests/_ingress_fakes.py), the registry is a fake
too. Version pinning, a group as one call weighing its n samples, retries of a lost replica (and none of a
refusal), the in-flight count.
The same path against real replicas, one SIGKILLed mid-group: tests/test_replica_loss.py."""
from __future__ import annotations

import asyncio

import pytest
import ray.exceptions as rex

from common.faults import REPLICA_CALL, RetryPolicy
from serve_deployments.admission import Admission
from serve_deployments.engine_weights import ReplicaError
from serve_deployments.replica import VersionExpiredError
from serve_deployments.rollout_groups import RolloutGroups
from tests._ingress_fakes import FakePool, served_versions

FAST = RetryPolicy(attempts=3, backoff_s=0.01, max_backoff_s=0.01, deadline_s=10.0)


def rollouts(answers: list, live=(3, 4), retry: RetryPolicy = FAST):
    pool, admission = FakePool(answers), Admission(16)
    return RolloutGroups(pool, served_versions(list(live)), admission, retry), pool, admission


def sample(version: int, i: int = 0) -> dict:
    return {"version": version, "token_ids": [i], "sha256": f"sha-{version}"}


def test_group_is_pinned_and_sent_as_one_call_of_its_weight():
    front, pool, admission = rollouts([[sample(4, i) for i in range(3)]])
    outs = asyncio.run(front.generate_group([5, 6, 7], 3, None, {"max_tokens": 2}, drop_if_expired=True))
    assert outs == [sample(4, i) for i in range(3)]
    [(method, (req, n), key)] = pool.calls
    assert method == "generate_n" and n == 3 and key == {"ids": [5, 6, 7], "version": 4}
    assert pool.weights == [3]  # the replica's load counts the group's 3 sequences
    assert req == {"prompt_token_ids": [5, 6, 7], "version": 4, "sampling": {"max_tokens": 2},
                   "drop_if_expired": True}
    assert admission.inflight == 0 and admission.counts["replica_retries"] == 0


def test_versions_and_prompts_are_checked_first():
    front, pool, _ = rollouts([[sample(3)]])
    assert asyncio.run(front.generate_group([1], 1, 3))[0]["version"] == 3
    with pytest.raises(ValueError, match="not live"):
        asyncio.run(front.generate_group([1], 1, 9))
    with pytest.raises(ValueError, match="n must be"):
        asyncio.run(front.generate_group([1], 0))
    with pytest.raises(ValueError, match="prompt has 0 tokens"):
        asyncio.run(front.generate_group([], 1))
    with pytest.raises(ValueError, match="prompt has 64 tokens"):
        asyncio.run(front.generate_group([1] * 64, 1))
    assert len(pool.calls) == 1
    base, pool, _ = rollouts([[sample(0)]], live=())
    assert asyncio.run(base.generate_group([1], 1))[0]["version"] == 0  # nothing live: the base model
    assert pool.calls[0][1][0]["version"] == 0


def test_lost_replica_is_retried_under_the_pinned_version():
    # REPLICA_CALL itself: one retry after its first backoff.
    front, pool, admission = rollouts([rex.ActorDiedError(), [sample(4, 0), sample(4, 1)]], retry=REPLICA_CALL)
    outs = asyncio.run(front.generate_group([1, 2], 2, 4))
    assert sorted(o["token_ids"][0] for o in outs) == [0, 1] and {o["version"] for o in outs} == {4}
    assert len(pool.calls) == 2 and {c[1][0]["version"] for c in pool.calls} == {4}  # the group, sent again
    assert admission.counts["replica_retries"] == 1 and admission.inflight == 0


@pytest.mark.parametrize("refusal", [
    ReplicaError("prompt too long", 400),
    VersionExpiredError(4),
    rex.RayTaskError("generate", "Traceback ...", ReplicaError("policy-v4 is not held", 404)).as_instanceof_cause(),
    ValueError("a bug, not a lost replica"),
], ids=["status-400", "expired-410", "wrapped-404", "other"])
def test_refusal_is_raised_at_once(refusal):
    front, pool, admission = rollouts([refusal, [sample(4)]])
    with pytest.raises(type(refusal)):
        asyncio.run(front.generate_group([1, 2], 1, 4))
    assert len(pool.calls) == 1 and admission.counts["replica_retries"] == 0 and admission.inflight == 0


def test_retries_end_when_the_budget_does():
    lost = [rex.ActorDiedError() for _ in range(FAST.attempts)]
    front, pool, admission = rollouts(lost + [[sample(4)]])
    with pytest.raises(rex.ActorDiedError):
        asyncio.run(front.generate_group([1, 2], 1, 4))
    assert len(pool.calls) == FAST.attempts and admission.counts["replica_retries"] == FAST.attempts - 1
    assert admission.inflight == 0


def test_samples_count_in_flight_while_they_run():
    front, pool, admission = rollouts([])
    seen = []

    async def call(method, req, n, key=None, weight=1):
        seen.append(admission.inflight)
        await asyncio.sleep(0.01)
        return [sample(4)] * n

    pool.call = call
    assert len(asyncio.run(front.generate_group([1], 5, 4))) == 5
    assert seen == [5] and admission.inflight == 0


def test_version_trimmed_mid_episode_is_gone_for_rollouts():
    """A later turn of a long episode names a version the registry has trimmed since: for a rollout
    (drop_if_expired) that is 410 gone, so the worker starts the group over; for anyone else, not live."""
    from common.faults import is_gone

    front, pool, _ = rollouts([[sample(4)]], live=(3, 4))
    with pytest.raises(VersionExpiredError) as gone:
        asyncio.run(front.generate_group([1], 1, 2, drop_if_expired=True))
    assert is_gone(gone.value)
    with pytest.raises(ValueError, match="not live"):
        asyncio.run(front.generate_group([1], 1, 2))
    assert not pool.calls
    assert asyncio.run(front.pin_version()) == 4


def test_a_partial_turn_naming_a_version_not_live_starts_under_the_newest_live_one():
    """rollout.partial, a multi-turn episode's next turn names the version its previous turn ended under. Trimmed
    since, or not live yet (a replica moves partial samples to a version as it loads it, before the registry
    marks it live once every replica has): the turn starts under the newest live version instead of failing
    the group ("not live" was a ValueError, which ends the rollout worker). Without partial it stays an error."""
    front, pool, _ = rollouts([[sample(4)]] * 3, live=(3, 4))
    for asked in (2, 5, 4):
        asyncio.run(front.generate_group([1], 1, asked, drop_if_expired=True, partial="all"))
    assert [c[1][0]["version"] for c in pool.calls] == [4, 4, 4]
    with pytest.raises(ValueError, match="not live"):
        asyncio.run(front.generate_group([1], 1, 5, drop_if_expired=True))
    base, pool, _ = rollouts([[sample(0)]], live=())  # the first publish still loading: the base model
    asyncio.run(base.generate_group([1], 1, 1, drop_if_expired=True, partial="at_limit"))
    assert pool.calls[0][1][0]["version"] == 0 and pool.calls[0][1][0]["partial"] == "at_limit"
