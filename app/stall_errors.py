"""Why a watched run ended without progress. Each is a StallError: the CLI prints its message (which says
how to resume) and exits 1. app/watch.py raises the first two, app/placement_watch.py the third."""
from __future__ import annotations


class StallError(RuntimeError):
    """No step finished and nothing was generated for `run.stall_timeout_s`."""


class RestartsError(StallError):
    """The train worker group restarted more than `train.max_restarts` times with no step logged between."""


class UnplaceableError(StallError):
    """The run waited `run.placement_timeout_s` for Ray to place its workers or replicas, with no step."""
