"""The environment protocol of multi-turn episodes (`env.cls: "module:Class"`), and its checks.

Per episode the rollout worker builds `Class(row)` with the data row, then
- `reset() -> list[dict]`: the opening messages (chat format: {role, content});
- `step(assistant_text: str) -> {"observations": list[dict], "reward": float | None, "done": bool}`:
  the messages to append (tool results have role `tool`), this turn's reward, whether the episode ended;
- optionally a `tools` attribute: tool schemas (app/tools.ToolBox.schemas) the chat template renders;
- optionally `close()`: called once however the episode ends (done, truncated, failed, cancelled), and a
  `truncated` attribute: true when the environment ended the episode by its own limit.
`async def` versions are awaited. Shapes are checked here: a wrong one fails its episode with the reason
(`EnvError`), never the worker; a class that cannot be loaded fails the run at start-up (`load_env`).
"""
from __future__ import annotations

import asyncio
import inspect
import math
from dataclasses import dataclass

ROLES = ("system", "user", "assistant", "tool")


class EnvError(RuntimeError):
    """An episode's environment raised, timed out or answered in the wrong shape: the episode fails."""


@dataclass
class StepResult:
    observations: list[dict]
    reward: float | None
    done: bool


def load_env(dotted: str) -> type:
    """Import `module:Class` and check it has callable `reset` and `step`; errors name env.cls."""
    from common.dotted import load_dotted

    cls = load_dotted(dotted, "env.cls", "class")
    if not inspect.isclass(cls):
        mod_name, _, cls_name = dotted.partition(":")
        raise ValueError(f"env.cls: {mod_name} has no class {cls_name!r}")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"env.cls: {dotted} lacks {' and '.join(missing)} (an environment has reset() -> messages "
                         "and step(assistant_text) -> {observations, reward, done})")
    return cls


def check_env(dotted: str, row: dict, timeout_s: float = 60.0) -> None:
    """Start-up check on one data row: the class loads, `Class(row)` builds and `reset()` returns
    messages. Raises ValueError naming env.cls and the problem, before any engine starts."""
    cls = load_env(dotted)
    try:
        env = cls(row)
        messages = asyncio.run(call(env.reset, timeout_s=timeout_s))
        check_messages(messages, f"{dotted}.reset()")
        tools = getattr(env, "tools", None)
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise EnvError(f"{dotted}.tools must be a list of tool schemas (dicts), got {type(tools).__name__}")
    except EnvError as e:
        raise ValueError(f"env.cls: {e}") from None
    except Exception as e:
        raise ValueError(f"env.cls: {dotted} failed on data row {row.get('id')!r}: {type(e).__name__}: {e}") from e


async def call(fn, *args, timeout_s: float):
    """`fn(*args)`, awaited if it is a coroutine function, run in a thread if not (a slow environment
    must not block the worker's other episodes), under `timeout_s`."""
    try:
        if inspect.iscoroutinefunction(fn):
            return await asyncio.wait_for(fn(*args), timeout_s)
        result = await asyncio.wait_for(asyncio.to_thread(fn, *args), timeout_s)
        return await asyncio.wait_for(result, timeout_s) if inspect.isawaitable(result) else result
    except (TimeoutError, asyncio.TimeoutError):
        raise EnvError(f"{getattr(fn, '__qualname__', fn)} took longer than env.step_timeout_s={timeout_s:g}s") \
            from None


def check_messages(messages, where: str) -> list[dict]:
    if not isinstance(messages, list):
        raise EnvError(f"{where} must return a list of messages, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise EnvError(f"{where}: message {i} is not a {{role, content}} chat message with role in "
                           f"{'/'.join(ROLES)} and string content: {str(m)[:120]}")
    return messages


def check_step(result, where: str) -> StepResult:
    """A step's return value as a StepResult; EnvError naming what is wrong."""
    if not isinstance(result, dict):
        raise EnvError(f"{where} must return a dict with observations, reward, done; got {type(result).__name__}")
    unknown = set(result) - {"observations", "reward", "done"}
    if unknown:
        raise EnvError(f"{where} returned unknown keys {sorted(unknown)} (allowed: observations, reward, done)")
    obs = check_messages(result.get("observations", []) or [], f"{where} observations")
    reward = result.get("reward")
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise EnvError(f"{where} reward must be a finite number or None, got {reward!r}")
        reward = float(reward)
    done = result.get("done", False)
    if not isinstance(done, bool):
        raise EnvError(f"{where} done must be a bool, got {done!r}")
    return StepResult(observations=obs, reward=reward, done=done)
