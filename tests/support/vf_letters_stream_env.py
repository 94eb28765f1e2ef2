"""The letters task as an infinite verifiers taskset (`Taskset.INFINITE`: `load()` is a generator that never ends):
a run reads its first `data.builtin_size` tasks, and `eval.path: verifiers` holds out the ones after them."""
from __future__ import annotations

import random

import verifiers.v1 as vf
from vf_letters_env import LETTERS, LettersData, LettersTask


class LettersStreamConfig(vf.TasksetConfig):
    seed: int = 0


class LettersStreamTaskset(vf.Taskset[LettersTask, LettersStreamConfig]):
    INFINITE = True

    def load(self):
        rng = random.Random(self.config.seed)
        i = 0
        while True:
            answer, *others = rng.sample(LETTERS, 3)
            prompt = f"Say the letter {answer}, not {others[0]} or {others[1]}."
            yield LettersTask(LettersData(id=f"stream-{i}", prompt=prompt, answer=answer), self.config.task)
            i += 1


__all__ = ["LettersStreamTaskset"]
