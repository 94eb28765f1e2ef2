"""A verifiers (v1) environment with two seats (a player and a modeled user, as verifiers' user-sim env has): only
one-seat environments train here, so loading it is a config error naming the seats."""
from __future__ import annotations

import verifiers.v1 as vf
from vf_letters_env import LettersTaskset


class TwoSeatConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()
    user: vf.AgentConfig = vf.AgentConfig()


class TwoSeatEnv(vf.Env[TwoSeatConfig]):
    async def run(self, task, agents):
        await agents.player.run(task)


__all__ = ["LettersTaskset", "TwoSeatEnv"]
