"""The AdapterRegistry's load retry (common.faults.ADAPTER_LOAD): a load that failed because a replica or
the ingress was lost is tried again through a fresh ingress handle, and counted; one the replicas refused
is not retried, and the version is dropped.

The registry's own class runs in this process (a local Ray instance holds its payloads). The ingress is
a fake handle: the real ingress raises a `LostError` for a load a dying replica failed only once the
serving side says so, and what is under test here is the registry's side of that contract."""
from __future__ import annotations

import asyncio

import pytest

from common import faults

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


class _Call:
    def __init__(self, fn):
        self.remote = fn


class FakeIngress:
    """`load_adapter` fails with `errors` in turn (shared over every handle taken), then succeeds."""

    def __init__(self, errors: list[BaseException], loads: list[int]):
        self.errors, self.loads = errors, loads
        self.load_adapter = _Call(self._load)
        self.expire = _Call(self._expire)

    async def _load(self, version: int) -> None:
        self.loads.append(version)
        if self.errors:
            raise self.errors.pop(0)

    async def _expire(self, versions: list[int]) -> dict:
        return {"aborted": 0}


class Refused(RuntimeError):
    status_code = 400  # the replica refused the payload on purpose


def _registry(monkeypatch, errors: list[BaseException]):
    from ray import serve

    from common.registry import AdapterRegistry

    monkeypatch.setattr(faults, "ADAPTER_LOAD", faults.RetryPolicy(attempts=5, backoff_s=0.01, max_backoff_s=0.01,
                                                                   deadline_s=30.0))
    loads: list[int] = []
    handles: list[FakeIngress] = []

    def get_app_handle(name: str) -> FakeIngress:
        assert name == "app"
        handles.append(FakeIngress(errors, loads))
        return handles[-1]

    monkeypatch.setattr(serve, "get_app_handle", get_app_handle)
    return AdapterRegistry.__ray_actor_class__(keep=3), loads, handles


def test_a_lost_load_is_retried_through_a_fresh_handle(ray_local, monkeypatch):
    import torch

    registry, loads, handles = _registry(monkeypatch, [faults.LostError("replica died mid-load"),
                                                       faults.LostError("replica died mid-load")])

    async def go():
        await registry.attach_ingress("app")
        rec = await registry.publish(1, {"w": torch.ones(2)}, {"kind": "adapter", "sha256": "x"})
        return rec, await registry.live_versions(), await registry.get(1)

    rec, live, got = asyncio.run(go())
    assert rec["load_retries"] == 2 and loads == [1, 1, 1]
    assert len(handles) == 3  # the attach, then a fresh handle for each retry
    assert live == [1] and got["meta"]["sha256"] == "x"
    assert torch.equal(ray_local.get(got["ref"][0])["w"], torch.ones(2))


def test_a_refused_load_is_not_retried_and_the_version_is_dropped(ray_local, monkeypatch):
    import torch

    registry, loads, handles = _registry(monkeypatch, [Refused("bad rank")])

    async def go():
        await registry.attach_ingress("app")
        with pytest.raises(Refused):
            await registry.publish(1, {"w": torch.ones(2)}, {"kind": "adapter"})
        with pytest.raises(KeyError):
            await registry.get(1)
        return await registry.live_versions()

    assert asyncio.run(go()) == [] and loads == [1] and len(handles) == 1


def test_every_version_keeps_its_digest_trimmed_failed_or_published_again(ray_local, monkeypatch):
    """The rollout worker checks every version a sample ran under: the registry answers a trimmed version's
    digest, a failed publish's (its tokens were served for a moment, policy `all`), and after the same
    version is published again, the new payload's; a version never published is a KeyError."""
    import torch

    registry, _, _ = _registry(monkeypatch, [])
    registry._expire_later = lambda versions: None

    async def go():
        await registry.attach_ingress("app")
        for v in (1, 2, 3, 4, 5):
            await registry.publish(v, {"w": torch.ones(2)}, {"kind": "adapter", "sha256": f"d{v}"})
        assert await registry.live_versions() == [3, 4, 5]
        assert [await registry.digest(v) for v in (1, 2, 5)] == ["d1", "d2", "d5"]
        registry._ingress.errors.append(Refused("a replica refused it"))
        with pytest.raises(Refused):
            await registry.publish(6, {"w": torch.ones(2)}, {"kind": "adapter", "sha256": "failed"})
        assert await registry.digest(6) == "failed" and await registry.live_versions() == [3, 4, 5]
        await registry.publish(6, {"w": torch.zeros(2)}, {"kind": "adapter", "sha256": "d6"})
        assert await registry.digest(6) == "d6"
        with pytest.raises(KeyError, match="never published"):
            await registry.digest(7)

    asyncio.run(go())


def test_a_held_version_outlives_the_live_window_until_released_or_its_lease_ends(ray_local, monkeypatch):
    """An evaluation holds the version it scores: it stays live (payload too) while newer versions turn
    over, leaves at release, and a holder that never releases loses it when its lease ends."""
    import torch

    registry, loads, _ = _registry(monkeypatch, [])
    expired: list[list[int]] = []

    async def record_expiry(versions):
        expired.append(list(versions))

    registry._expire = record_expiry

    async def go():
        await registry.attach_ingress("app")
        for v in (1, 2, 3):
            await registry.publish(v, {"w": torch.full((2,), float(v))}, {"kind": "adapter"})
        assert await registry.hold(2, "eval", 60.0) == 2
        assert await registry.hold(9, "other", 60.0) == 3  # not live yet: the newest older one
        for v in (4, 5, 6, 7):
            await registry.publish(v, {"w": torch.full((2,), float(v))}, {"kind": "adapter"})
        live_held = await registry.live_versions()
        payload = await registry.get(2)
        await registry.release(2, "eval")
        await registry.release(3, "other")
        await asyncio.sleep(0)  # the expiry task runs
        live_after = await registry.live_versions()
        with pytest.raises(KeyError):
            await registry.get(2)
        assert await registry.hold(7, "dies", 0.05) == 7
        for v in (8, 9, 10, 11):
            await asyncio.sleep(0.06)
            await registry.publish(v, {"w": torch.full((2,), float(v))}, {"kind": "adapter"})
        return live_held, payload, live_after, await registry.live_versions(), await registry.stats()

    live_held, payload, live_after, live_lapsed, stats = asyncio.run(go())
    assert live_held == [2, 3, 5, 6, 7]  # keep=3 plus the two held
    assert torch.equal(ray_local.get(payload["ref"][0])["w"], torch.full((2,), 2.0))
    assert live_after == [5, 6, 7]
    assert live_lapsed == [9, 10, 11] and stats["held_versions"] == []
    assert [2, 3] in expired or ([2] in expired and [3] in expired)  # replicas told to abort the released ones
    with pytest.raises(ValueError, match="ttl_s"):
        asyncio.run(registry.hold(9, "x", 0))
