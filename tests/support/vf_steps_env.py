"""A multi-turn verifiers (v1) environment written the way a third party writes one, outside the project's code:
the model is asked for a letter, the environment answers each reply with feedback ("Right." / "No, it was K.")
and the next letter to say, for `turns` turns. The module exports its `Taskset` and its own `Env`, whose `run()`
drives the exchange through `agents.player.interaction(task)` as verifiers' TextArena env does; the rubric is an
exact-match `@vf.reward` on the last reply plus a `record_reward` in `run()` (the fraction of turns answered
right). `env.verifiers: vf_steps_env` (tests/support on the import path). `fail_after: N` (for the tests) makes
run() raise after N turns, the way an environment with a bug does."""
from __future__ import annotations

import random

import verifiers.v1 as vf

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


class StepsData(vf.TaskData):
    answers: list[str]


class StepsTask(vf.Task[StepsData, vf.State]):
    @vf.reward(weight=0.5)
    async def last_exact(self, task: StepsData, trace: vf.Trace) -> float:
        return float(trace.last_reply == task.answers[-1])


class StepsTasksetConfig(vf.TasksetConfig):
    size: int = 64
    turns: int = 3
    seed: int = 0
    fail_after: int = 0


class StepsTaskset(vf.Taskset[StepsTask, StepsTasksetConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        for i in range(self.config.size):
            answers = rng.sample(LETTERS, self.config.turns)
            yield StepsTask(StepsData(id=f"steps-{i}", prompt=f"Say the letter {answers[0]}.", answers=answers),
                            self.config.task)


class StepsEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class StepsEnv(vf.Env[StepsEnvConfig]):
    async def run(self, task, agents):
        answers, right = task.data.answers, 0
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            for k in range(len(answers)):
                if segment.terminated:
                    break
                if k + 1 == self.taskset.config.fail_after:
                    raise RuntimeError(f"environment bug on purpose after turn {k + 1}")
                hit = segment.last_reply == answers[k]
                right += hit
                if k + 1 == len(answers):
                    break
                feedback = "Right." if hit else f"No, it was {answers[k]}."
                segment = await interaction.turn(f"{feedback} Now say the letter {answers[k + 1]}.")
        interaction.trace.record_reward("steps_right", right / len(answers), 0.5)


__all__ = ["StepsTaskset", "StepsEnv"]
