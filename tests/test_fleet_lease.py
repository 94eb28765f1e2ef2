"""FleetState's lease clock (serve_deployments/fleet_state.py), run as a plain object on one event loop.

The fleet ingress is a stand-in whose attach_run returns only when the test lets it: on a loaded 2-core head
the handle lookup and the ingress call once took 9 s, and a lease counted from the attach request ran out
before the run's first renewal (CI, test_fleet: run b forgotten 1 s after it was told it was attached). No Ray
or Serve runs here: the slow ingress is the thing under test, and a real one cannot be made slow on demand.
The checks read the lease's deadline, not the wall clock, so a busy machine cannot fail them.
"""
from __future__ import annotations

import asyncio
import time

import pytest

from serve_deployments import fleet_state
from serve_deployments.fleet_state import FleetError, digest

ADMIN = "admin-token"
LEASE_S = 1.0


class GatedIngress:
    """What FleetState calls on the fleet's ingress: attach_run waits for `release`; forget_run is counted."""

    def __init__(self):
        self.release = asyncio.Event()
        self.forgotten: list[str] = []
        self.attach_run = self._Method(self._attach)
        self.forget_run = self._Method(self._forget)

    class _Method:
        def __init__(self, fn):
            self.remote = fn

    async def _attach(self, run, slots, weight):
        await self.release.wait()

    async def _forget(self, run):
        self.forgotten.append(run)
        return {}


def _state(monkeypatch, ingress: GatedIngress):
    monkeypatch.setattr(fleet_state, "REAP_EVERY_S", 0.05)
    state = fleet_state.FleetState.__ray_actor_class__("t", "fleet-t", capacity=8, max_lora_rank=8,
                                                       admin_sha=digest(ADMIN), lease_s=LEASE_S)
    state._ingress = ingress
    state._start_card = lambda run: None  # the run's dashboard card needs Serve
    state._end_card = lambda run: None
    return state


def test_lease_starts_when_the_attach_returns(monkeypatch):
    async def scenario():
        ingress = GatedIngress()
        state = _state(monkeypatch, ingress)
        t0 = time.monotonic()
        attach = asyncio.ensure_future(state.attach(ADMIN, "a", slots=2))
        await asyncio.sleep(3 * LEASE_S)  # the attach outlasts a whole lease, and the reaper runs meanwhile
        assert ingress.forgotten == [] and "a" in await state.runs()
        ingress.release.set()
        out = await attach
        # Counted from the attach's end, not its start (the old clock: t0 + LEASE_S, long past).
        assert state._runs["a"]["deadline"] >= t0 + 3 * LEASE_S + LEASE_S
        # No await between the attach's answer and the first renewal: the reaper cannot slip in.
        assert await state.renew("a", out["token"]) == LEASE_S
        deadline = time.monotonic() + 30
        while not ingress.forgotten and time.monotonic() < deadline:  # no more renewals: forgotten
            await asyncio.sleep(0.05)
        assert ingress.forgotten == ["a"]
        with pytest.raises(FleetError, match="not attached"):
            await state.renew("a", out["token"])

    asyncio.run(scenario())


def test_a_run_mid_attach_shows_a_whole_lease(monkeypatch):
    async def scenario():
        ingress = GatedIngress()
        state = _state(monkeypatch, ingress)
        attach = asyncio.ensure_future(state.attach(ADMIN, "a", slots=2))
        await asyncio.sleep(0.1)
        runs = await state.runs()  # listed while attaching, never as an infinite lease (JSON, status tables)
        assert runs["a"]["lease_left_s"] == LEASE_S, runs
        with pytest.raises(FleetError, match=r"already attached .* ends in \d+s"):
            await state.attach(ADMIN, "a", slots=2)
        ingress.release.set()
        await attach
        assert 0 < (await state.runs())["a"]["lease_left_s"] <= LEASE_S

    asyncio.run(scenario())
