"""FleetState's lease clock (serve_deployments/fleet_state.py), run as a plain object on one event loop.

The fleet ingress is a stand-in whose attach_run is slow: on a loaded 2-core head, the handle lookup and the
ingress call once took 9 s, and a lease counted from the attach request ran out before the run's first renewal
(CI, test_fleet: run b forgotten 1 s after it was told it was attached). No Ray or Serve runs here; the slow
ingress is the thing under test, and a real one cannot be made slow on demand.
"""
from __future__ import annotations

import asyncio

import pytest

from serve_deployments import fleet_state
from serve_deployments.fleet_state import FleetError, digest

ADMIN = "admin-token"
LEASE_S = 0.5


class SlowIngress:
    """What FleetState calls on the fleet's ingress: attach_run takes `delay` seconds; forget_run is counted."""

    def __init__(self, delay: float):
        self.delay = delay
        self.forgotten: list[str] = []
        self.attach_run = self._Method(self._attach)
        self.forget_run = self._Method(self._forget)

    class _Method:
        def __init__(self, fn):
            self.remote = fn

    async def _attach(self, run, slots, weight):
        await asyncio.sleep(self.delay)

    async def _forget(self, run):
        self.forgotten.append(run)
        return {}


def _state(monkeypatch, ingress: SlowIngress):
    monkeypatch.setattr(fleet_state, "REAP_EVERY_S", 0.05)
    state = fleet_state.FleetState.__ray_actor_class__("t", "fleet-t", capacity=8, max_lora_rank=8,
                                                       admin_sha=digest(ADMIN), lease_s=LEASE_S)
    state._ingress = ingress
    state._start_card = lambda run: None  # the run's dashboard card needs Serve
    state._end_card = lambda run: None
    return state


def test_lease_starts_when_the_attach_returns(monkeypatch):
    async def scenario():
        ingress = SlowIngress(delay=3 * LEASE_S)  # the attach outlasts a whole lease
        state = _state(monkeypatch, ingress)
        out = await state.attach(ADMIN, "a", slots=2)
        assert out["lease_s"] == LEASE_S
        runs = await state.runs()
        assert "a" in runs and 0 < runs["a"]["lease_left_s"] <= LEASE_S, runs
        await asyncio.sleep(LEASE_S / 4)
        assert await state.renew("a", out["token"]) == LEASE_S  # the first renewal finds the run attached
        assert ingress.forgotten == []
        await asyncio.sleep(LEASE_S + 0.3)  # no renewals: the lease runs out and the reaper forgets it
        assert ingress.forgotten == ["a"]
        with pytest.raises(FleetError, match="not attached"):
            await state.renew("a", out["token"])

    asyncio.run(scenario())


def test_a_run_mid_attach_shows_a_whole_lease(monkeypatch):
    async def scenario():
        state = _state(monkeypatch, SlowIngress(delay=LEASE_S))
        attach = asyncio.ensure_future(state.attach(ADMIN, "a", slots=2))
        await asyncio.sleep(LEASE_S / 5)
        runs = await state.runs()  # listed while attaching, never as an infinite lease (JSON, status tables)
        assert runs["a"]["lease_left_s"] == LEASE_S, runs
        with pytest.raises(FleetError, match=r"already attached .* ends in \d+s"):
            await state.attach(ADMIN, "a", slots=2)
        await attach

    asyncio.run(scenario())
