"""Reward functions, named in config by dotted path `module:function`.

Signature: `fn(completion: str, answer: str, prompt: str) -> float`. They run in the rollout workers
(or as Ray tasks with reward.where=task), so they must be picklable module-level functions.
"""
from __future__ import annotations

import importlib
import re
from typing import Callable

RewardFn = Callable[[str, str, str], float]


def letter_reward(completion: str, answer: str, prompt: str = "") -> float:
    """The toy task: 1 when the reply is exactly the named letter (surrounding whitespace ignored)."""
    return 1.0 if completion.strip() == answer.strip() else 0.0


_BOXED = re.compile(r"\\boxed\s*\{")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, braces balanced; None if there is none."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    i = depth = starts[-1]
    depth = 1
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[starts[-1]:i]
        i += 1
    return None  # unbalanced: truncated completion


def boxed_math_reward(completion: str, answer: str, prompt: str = "") -> float:
    """1 when the last \\boxed{} answer is mathematically equal to the reference (math-verify)."""
    got = last_boxed(completion)
    if got is None:
        return 0.0
    from math_verify import parse, verify

    gold = parse(f"${answer}$") or parse(answer)
    pred = parse(f"${got}$") or parse(got)
    if not gold or not pred:
        return float(got.strip() == answer.strip())
    try:
        return 1.0 if verify(gold, pred) else 0.0
    except Exception:  # math-verify raises on exotic input; a wrong format earns nothing
        return 0.0


def load_reward(dotted: str) -> RewardFn:
    """Import `module:function`; errors name the config key and what is wrong."""
    mod_name, _, fn_name = dotted.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"reward.fn: cannot import module {mod_name!r} ({e})") from e
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ValueError(f"reward.fn: {mod_name} has no function {fn_name!r}")
    return fn
