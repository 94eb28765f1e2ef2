"""The policy losses' names, each with the line `train --help` shows: what `grpo.loss` may be.

Torch-free and import-free, so the config can type `grpo.loss` by `PolicyLossName` and print the help without
loading torch; `train_loops/losses.py` checks at import that its registry holds exactly these names.
Adding a loss: its name in `PolicyLossName`, its help line in `POLICY_LOSSES`, its function in losses.py.
"""
from __future__ import annotations

import typing
from typing import Literal

PolicyLossName = Literal["grpo", "dr_grpo", "gspo", "cispo", "dapo"]
LOSS_NAMES: tuple[str, ...] = typing.get_args(PolicyLossName)

POLICY_LOSSES: dict[PolicyLossName, str] = {
    "grpo": "PPO-clipped surrogate per token against the vLLM behaviour logprobs (clip_eps_low/high, "
            "tis_cap, loss_agg)",
    "dr_grpo": "Dr. GRPO: the grpo surrogate, advantages not divided by the group std, each sequence's token sum "
               "divided by the constant dr_grpo_norm_len (not by its length)",
    "gspo": "Qwen GSPO: sequence ratio exp(mean token log-ratio), clipped per sequence at "
            "gspo_clip_eps_low/high, token-level gradient (GSPO-token), mean over sequences",
    "cispo": "MiniMax-M1 CISPO: REINFORCE weighted by the detached clipped IS ratio "
             "clip(r, 1-cispo_eps_low, 1+cispo_eps_high); no token is dropped (loss_agg)",
    "dapo": "DAPO: the surrogate with clip-higher (dapo_clip_eps_low/high), token mean over the whole step; full "
            "DAPO adds dynamic_sampling=true and dapo_overlong_buffer > 0",
}

if tuple(POLICY_LOSSES) != LOSS_NAMES:
    raise RuntimeError(f"POLICY_LOSSES documents {tuple(POLICY_LOSSES)} but PolicyLossName is {LOSS_NAMES}")
