"""Reward functions of the speed benchmarks (config `reward.fn=benchmarks.rewards:NAME`; the rollout workers
import this module, so the repository root must be on their PYTHONPATH)."""
from __future__ import annotations

import zlib


def hash_reward(completion: str, answer: str = "", prompt: str = "") -> float:
    """A pseudo-random 0/1 of the completion text (crc32 parity). There is no skill to learn, but groups get
    mixed rewards, so every step has a gradient and publishes a new adapter; a random-weights model earns 0
    from any real task and would only ever tag."""
    return float(zlib.crc32(completion.encode("utf-8", "replace")) & 1)
