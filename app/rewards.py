"""Reward functions, named in config by dotted path `module:function`.

Signature: `fn(completion: str, answer: str, prompt: str) -> float`. A function that also accepts the
keyword `row` gets the whole data row (a dict: id, prompt, answer and any extra columns), and one that
accepts `finish_reason` gets vLLM's reason the completion ended ("stop", "length", ...); in a multi-turn
run (env.cls) `completion` is the last assistant turn and one that accepts `trajectory` gets the whole
episode ({messages, finish_reasons, step_rewards, truncated}); `**kwargs` gets them all. `load_scorer`
inspects the signature once. They run in the rollout workers (or as Ray tasks with reward.where=task), so
they must be picklable module-level functions.

`overlong_penalty` is DAPO's soft overlong punishment, added to the reward by the rollout workers when
grpo.dapo_overlong_buffer > 0.
"""
from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass

RewardFn = Callable[[str, str, str], float]


def letter_reward(completion: str, answer: str, prompt: str = "") -> float:
    """The toy task: 1 when the reply is exactly the named letter (surrounding whitespace ignored)."""
    return 1.0 if completion.strip() == answer.strip() else 0.0


_BOXED = re.compile(r"\\boxed\s*\{")


def _closed_at(text: str, start: int) -> str | None:
    """text[start:] up to the brace that closes the one before `start`; None if none does."""
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, braces balanced; None if there is none."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    return _closed_at(text, starts[-1])  # None: unbalanced, a truncated completion


def first_boxed(text: str) -> str | None:
    """Content of the first \\boxed{...} whose braces close; None if there is none."""
    for m in _BOXED.finditer(text):
        got = _closed_at(text, m.end())
        if got is not None:
            return got
    return None


def _math_equal(got: str | None, answer: str) -> float:
    if got is None:
        return 0.0
    import threading

    from math_verify import parse, verify

    # math-verify times out with signal.alarm, which only the main thread may use: elsewhere (an async Ray
    # actor's event loop, the Evaluator) its parse raises ValueError unless the timeout is off.
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"${answer}$", parsing_timeout=limit) or parse(answer, parsing_timeout=limit)
    pred = parse(f"${got}$", parsing_timeout=limit) or parse(got, parsing_timeout=limit)
    if not gold or not pred:
        return float(got.strip() == answer.strip())
    try:
        return 1.0 if verify(gold, pred, timeout_seconds=limit) else 0.0
    except Exception:  # math-verify raises on exotic input; a wrong format earns nothing
        return 0.0


def boxed_math_reward(completion: str, answer: str, prompt: str = "") -> float:
    """1 when the last \\boxed{} answer is mathematically equal to the reference (math-verify)."""
    return _math_equal(last_boxed(completion), answer)


def first_boxed_math_reward(completion: str, answer: str, prompt: str = "") -> float:
    """boxed_math_reward on the FIRST \\boxed{} answer: a pretrained (not instruction-tuned) model rarely
    ends its turn after answering and writes on, other boxed numbers included (Gemma 3 270M does)."""
    return _math_equal(first_boxed(completion), answer)


def overlong_penalty(length: int, max_len: int, buffer: int, penalty: float = 1.0) -> float:
    """DAPO's soft overlong punishment: 0 up to max_len - buffer tokens, then falling linearly to -penalty at
    max_len (and -penalty beyond). buffer 0 = off."""
    if buffer <= 0:
        return 0.0
    over = length - (max_len - buffer)
    if over <= 0:
        return 0.0
    return -penalty * min(over / buffer, 1.0)


_EXTRAS = ("row", "finish_reason", "trajectory")


def extra_reward_kwargs(fn: Callable) -> tuple[str, ...]:
    """Which of `row`, `finish_reason` the reward function takes as keywords (both for `**kwargs`)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        return ()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return _EXTRAS
    kw = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(p.name for p in params if p.name in _EXTRAS and p.kind in kw)


@dataclass(frozen=True)
class Scorer:
    """A reward function and the extra keywords it takes; `scorer(completion, row, finish_reason)`."""

    fn: Callable
    extras: tuple[str, ...] = ()

    def __call__(self, completion: str, row: dict, finish_reason: str | None = None,
                 trajectory: dict | None = None) -> float:
        given = {"row": row, "finish_reason": finish_reason, "trajectory": trajectory}
        return float(self.fn(completion, row["answer"], row["prompt"], **{k: given[k] for k in self.extras}))


def scorer_for(fn: Callable) -> Scorer:
    return Scorer(fn, extra_reward_kwargs(fn))


def load_scorer(dotted: str) -> Scorer:
    """`load_reward` plus the signature inspection: what the rollout workers call."""
    return scorer_for(load_reward(dotted))


def load_reward(dotted: str) -> RewardFn:
    """Import `module:function`; errors name the config key and what is wrong."""
    from common.dotted import load_dotted

    fn = load_dotted(dotted, "reward.fn", "function")
    if not callable(fn):
        mod_name, _, fn_name = dotted.partition(":")
        raise ValueError(f"reward.fn: {mod_name} has no function {fn_name!r}")
    return fn
