"""A verifiers (v1) environment written the way a third party writes one, outside the project's code: the
letters task as a `Taskset` of `Task`s with one exact-match `@vf.reward`. `env.verifiers:
tests.support.vf_letters_env` loads it through verifiers' own loader (the module exports one Taskset)."""
from __future__ import annotations

import random

import verifiers.v1 as vf

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


class LettersData(vf.TaskData):
    answer: str


class LettersTask(vf.Task[LettersData, vf.State]):
    @vf.reward(weight=1.0)
    async def exact_match(self, task: LettersData, trace: vf.Trace) -> float:
        return float(trace.last_reply == task.answer)  # last_reply is stripped

    @vf.reward(weight=0.0)
    async def starts_with_answer(self, task: LettersData, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip().upper().startswith(task.answer))


class LettersTasksetConfig(vf.TasksetConfig):
    size: int = 64
    seed: int = 0


class LettersTaskset(vf.Taskset[LettersTask, LettersTasksetConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        for i in range(self.config.size):
            answer, *others = rng.sample(LETTERS, 3)
            prompt = f"Say the letter {answer}, not {others[0]} or {others[1]}."
            yield LettersTask(LettersData(id=f"letters-{i}", prompt=prompt, answer=answer), self.config.task)


__all__ = ["LettersTaskset"]
