"""Processes this one started: its descendants, read from /proc (Linux; the processes of a local Ray cluster it
started), and ending a child."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path


def descendant_pids(title_part: str) -> list[int]:
    """PIDs of this process's descendants whose command line holds `title_part` (Ray titles a Serve replica
    process `ray::ServeReplica:APP:DEPLOYMENT...`). Other Ray instances on the machine are never looked at."""
    parent: dict[int, int] = {}
    cmd: dict[int, str] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
    me = os.getpid()

    def mine(pid: int) -> bool:
        seen = 0
        while pid > 1 and seen < 64:
            if pid == me:
                return True
            pid, seen = parent.get(pid, 0), seen + 1
        return False

    return [pid for pid, c in cmd.items() if title_part in c and pid != me and mine(pid)]


def end_process(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """End a child this process started: SIGTERM, up to `timeout_s` for it to go, then SIGKILL."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
