"""A verifiers environment whose task has no @vf.reward: nothing to train on, and a run must say so."""
from __future__ import annotations

import verifiers.v1 as vf


class PlainTaskset(vf.Taskset[vf.Task, vf.TasksetConfig]):
    def load(self):
        yield vf.Task(vf.TaskData(id="t0", prompt="Say A."))


__all__ = ["PlainTaskset"]
