"""A free TCP port for a server this process is about to start (Serve's HTTP port, a vLLM server, a
torchrun rendezvous).

Ports come from below the kernel's ephemeral range and above Ray's worker ports (10002-19999): every port
Ray binds for itself (a driver's gRPC server, agents, the GCS) is an ephemeral one, so a port picked here
cannot be taken by Ray between the pick and the server's bind. A run was lost to that once: the driver's
gRPC server got the very port picked for Serve a moment before, and Serve's proxy never bound.
"""
from __future__ import annotations

import random
import socket

PORT_RANGE = (20000, 32767)
_given: set[int] = set()  # a caller picks several before starting anything: never the same one twice


def free_port() -> int:
    """A port in PORT_RANGE that nothing listens on now and that this process has not handed out before."""
    lo, hi = PORT_RANGE
    for _ in range(200):
        port = random.randint(lo, hi)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise OSError(f"no free port in {lo}..{hi}")
