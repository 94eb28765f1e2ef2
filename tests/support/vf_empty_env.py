"""A verifiers environment whose taskset yields no task: a run on it has no dataset and must say so."""
from __future__ import annotations

import verifiers.v1 as vf


class EmptyTaskset(vf.Taskset[vf.Task, vf.TasksetConfig]):
    def load(self):
        return iter(())


__all__ = ["EmptyTaskset"]
