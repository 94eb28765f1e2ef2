"""common.ports.free_port: the ports tests hand to servers they start. They must never be ones Ray can
take for itself between the pick and the bind (every port Ray binds is an ephemeral one: CI lost a run to a
driver's gRPC server taking Serve's port), and a test picking several gets different ones."""
import socket

from common.ports import PORT_RANGE, free_port


def _ephemeral() -> tuple[int, int]:
    try:
        lo, hi = open("/proc/sys/net/ipv4/ip_local_port_range").read().split()
        return int(lo), int(hi)
    except OSError:  # not Linux: the IANA range
        return 49152, 65535


def test_ports_are_outside_the_ephemeral_range_and_never_repeat():
    lo, hi = _ephemeral()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(PORT_RANGE[0] <= p <= PORT_RANGE[1] for p in ports)
    assert not any(lo <= p <= hi for p in ports), (lo, hi, ports)


def test_a_port_in_use_is_skipped(monkeypatch):
    import random

    import common.ports

    monkeypatch.setattr(common.ports, "_given", set())  # the picks below are not ones given out earlier
    held = socket.socket()
    held.bind(("127.0.0.1", 0))  # any port in use; the pick is steered onto it first
    busy = held.getsockname()[1]
    picks = iter([busy, PORT_RANGE[0] + 7, PORT_RANGE[0] + 8, PORT_RANGE[0] + 9])
    monkeypatch.setattr(random, "randint", lambda a, b: next(picks))
    try:
        port = free_port()
        assert port != busy and PORT_RANGE[0] + 7 <= port <= PORT_RANGE[0] + 9
    finally:
        held.close()
