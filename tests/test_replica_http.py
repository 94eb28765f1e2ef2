"""The replica's own REST port, its parts apart from Serve and vLLM (serve_deployments/replica_http.py): the
port it binds, the in-process stream, and the runs it knows. The same port against a real replica, with the
malformed-request cases, names, digests and 429s: tests/test_hostile_rest.py; a fleet's read token on it:
tests/test_fleet.py. The replica here is a stand-in: these parts only read its slots and call its methods."""
from __future__ import annotations

import asyncio
import socket

import pytest

from serve_deployments.replica_http import LocalPool, ReplicaRuns, bind_socket


def test_bind_takes_the_next_free_port_and_names_the_range():
    taken = bind_socket("127.0.0.1", 0)  # any free port, held here
    port = taken.getsockname()[1]
    try:
        nxt = bind_socket("127.0.0.1", port)  # a second replica of the node
        assert nxt.getsockname()[1] > port
        nxt.close()
        with pytest.raises(OSError, match=rf"rollout.replica_http_port: no free port in {port}\.\.{port}"):
            bind_socket("127.0.0.1", port, tries=1)
    finally:
        taken.close()
    s = bind_socket("127.0.0.1", port)  # free again: the configured port itself
    assert s.getsockname()[1] == port and s.type == socket.SOCK_STREAM
    s.close()


class _Slots:
    def __init__(self, quotas: dict[str, int]):
        self.q = quotas

    def quotas(self) -> dict[str, int]:
        return dict(self.q)


class StandInReplica:
    """What LocalPool and ReplicaRuns use of RolloutReplica."""

    def __init__(self, quotas: dict[str, int], live: dict[str, list[int]]):
        self._slots = _Slots(quotas)
        self._live_versions = live
        self._base_version = 0
        self.closed: list[str] = []

    async def _live(self, run: str, cached: bool = False) -> list[int]:
        return self._live_versions.get(run, [])

    async def _registry_call(self, run: str, method: str, *args):
        return {"meta": {"sha256": f"{run}-{args[0]}"}}

    async def engine_info(self) -> dict:
        return {"block_size": 16}

    async def stats(self) -> dict:
        return {"replica_id": "r0"}

    async def _openai_events(self, path: str, body: dict):
        try:
            for i in range(3):
                yield f"data: {i}\n\n"
        finally:
            self.closed.append(path)


def test_runs_follow_the_replicas_quotas():
    replica = StandInReplica({"": 4}, {"": [1, 2]})
    runs = ReplicaRuns(replica)
    assert runs.runs() == [""] and asyncio.run(runs.get("").live()) == [1, 2]
    replica._slots.q.update(a=2)  # run a attached (the ingress broadcast its quota)
    replica._live_versions["a"] = [5]
    assert runs.runs() == ["", "a"] and asyncio.run(runs.get("a").live()) == [5]
    assert asyncio.run(runs.get("a").sha(5)) == "a-5"
    del replica._slots.q["a"]  # it left
    assert runs.runs() == [""]
    with pytest.raises(KeyError):
        runs.get("a")
    replica._base_version = 3  # merge mode: the base weights are policy-v3
    assert runs.get("").merged_version == 3


def test_pool_calls_the_replica_in_process_and_a_stream_closes_its_generator():
    replica = StandInReplica({"": 4}, {})
    pool = LocalPool(replica)

    async def scenario():
        assert await pool.engine_info() == {"block_size": 16}
        assert await pool.route_key([1, 2, 3], 1, 0) is None  # no routing: this replica serves it
        assert await pool.call("stats", key={"any": 1}, weight=8) == {"replica_id": "r0"}
        call = pool.stream("openai_stream", None)  # unbatched: the replica's own event stream
        gen = (await call.open()).send("/v1/completions", {})
        first = await gen.__anext__()
        gen.cancel()
        await call.close()  # the client left after one event
        return first

    assert asyncio.run(scenario()) == "data: 0\n\n" and replica.closed == ["/v1/completions"]
