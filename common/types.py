"""The records that cross from rollout to training, and the adapter version naming."""
from __future__ import annotations

import re
from dataclasses import dataclass

POLICY_PREFIX = "policy-v"
POLICY_LATEST = "policy-latest"
_POLICY_RE = re.compile(r"^policy-v(\d+)$")


def policy_name(version: int) -> str:
    """Serving name of a published adapter version. Never reused for other weights."""
    if version < 1:
        raise ValueError(f"policy versions start at 1, got {version}")
    return f"{POLICY_PREFIX}{version}"


def parse_policy_name(name: str) -> int | None:
    """`policy-v7` -> 7; anything else -> None."""
    m = _POLICY_RE.match(name)
    return int(m.group(1)) if m else None


def lora_int_id(version: int) -> int:
    """vLLM's per-adapter integer id; one per version (version 0 is the base model, no adapter)."""
    return int(version)


@dataclass
class Sample:
    """One scored completion, ready for the GRPO loss. A multi-turn episode is one Sample too: its
    `completion_ids` are every token after the opening prompt (each turn the engine sampled and the
    observations between them), `completion_mask` marks the sampled ones (1) from the context the
    environment added (0), and `behaviour_logprobs` has one entry per completion token (0.0 on context)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour_logprobs: list[float]
    reward: float
    advantage: float
    version: int  # policy version that sampled it
    prompt_id: str = ""
    group_id: str = ""
    completion_mask: list[int] | None = None  # None: every completion token was sampled (single-turn)
    episode: dict | None = None  # multi-turn only: app/episodes.EpisodeStats as a dict

    @property
    def sampled_tokens(self) -> int:
        """Tokens the policy sampled (the ones the loss covers)."""
        return len(self.completion_ids) if self.completion_mask is None else sum(self.completion_mask)


@dataclass
class Group:
    """G samples of one prompt, scored and with group-relative advantages."""

    samples: list[Sample]
    version: int
    prompt_id: str
    gen_seconds: float = 0.0
    gen_tokens: int = 0
    epoch: int = 0  # the data epoch its prompt was handed out in (common/data_cursor.py)

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]
