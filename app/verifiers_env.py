"""verifiers environments as the run's episodes (`env.verifiers: ID`, `env.args: {...}`; docs/VERIFIERS.md).

The environment is loaded the way verifiers loads it (`verifiers.v1.resolve_env_config` +
`load_environment` with `taskset={"id": ID, **args}`): the module named ID exports one `Taskset`, whose
tasks become the run's data rows (each row carries its task's wire data, so a worker rebuilds the task
without the taskset), and whose `Task` class holds the rubric (`@vf.reward` functions and their weights).
Each episode is one `VerifiersEpisode(row)` behind the project's episode protocol (app/envs.py): the environment's
own `Env.run(task, agents)` plays it (`SingleAgentEnv`'s one turn, or a module's `Env` subclass driving a
multi-turn exchange), every turn of its one seat sampled token-exactly under the group's pinned version by the
episode loop (app/episodes.py, through app/verifiers_bridge.py); the replies are committed into a verifiers
`Trace` (its own turn graph) and scored by `Task.score` (+ run()'s `record_reward`s and `finalize`): the
weighted sum of the rewards is the GRPO reward, each reward's score goes to the step metrics as `reward/NAME`.

verifiers is imported lazily: a run without `env.verifiers` never needs it, and one that needs it
without it installed gets one error naming the extra.
"""
from __future__ import annotations

import functools
import json

INSTALL_HINT = 'pip install -e ".[envs]"'


class VerifiersError(ValueError):
    """A verifiers environment cannot be used: not installed, unknown, no tasks, or no rubric."""


def import_verifiers():
    """`verifiers.v1`, or VerifiersError naming the extra that installs it."""
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise VerifiersError(f"env.verifiers: needs the `verifiers` package ({e}); {INSTALL_HINT}") from None
    return vf


@functools.lru_cache(maxsize=8)
def _load(env_id: str, args_json: str):
    vf = import_verifiers()
    args = json.loads(args_json)
    try:
        config = vf.resolve_env_config({"taskset": {**args, "id": env_id}})
        return vf.load_environment(config)
    except ModuleNotFoundError as e:
        raise VerifiersError(f"env.verifiers: no environment {env_id!r} is installed (verifiers imports the module "
                             f"named by the id: {e.msg.split('.', 1)[0]}); install its package, or check the id") \
            from None
    except Exception as e:
        raise VerifiersError(f"env.verifiers: {env_id!r} with env.args {args} failed to load: "
                             f"{type(e).__name__}: {e}") from None


def load(env_cfg):
    """The verifiers `Env` of `env_cfg` (EnvConfig), loaded once per process."""
    return _load(env_cfg.verifiers, json.dumps(dict(env_cfg.args), sort_keys=True, default=str))


def reward_names(task) -> list[str]:
    """The names of a task's reward functions (its rubric), in verifiers' order."""
    return [fn.__name__ for fn in task.hooks("reward")]


def verifiers_rows(env_cfg, limit: int) -> list[dict]:
    """The environment's tasks as data rows `{id, prompt, answer, vf_task}` (at most `limit` from an infinite
    taskset). VerifiersError when it has no tasks, or its tasks no reward function."""
    env = load(env_cfg)
    taskset = env.taskset if env.taskset.bounded else env.taskset.take(limit)
    rows = []
    for task in taskset:
        rows.append(task_row(task))
        if len(rows) == 1 and not reward_names(task) and single_agent(env):  # an Env's run() may record_reward
            raise VerifiersError(f"env.verifiers: {env_cfg.verifiers!r}: its task {type(task).__name__} has no "
                                 "@vf.reward function (no rubric to train on)")
    if not rows:
        raise VerifiersError(f"env.verifiers: {env_cfg.verifiers!r}: its taskset "
                             f"{type(env.taskset).__name__} yielded no tasks (no dataset to train on)")
    return rows


def task_row(task) -> dict:
    """A task as a data row `{id, prompt, answer, vf_task}` (vf_task: its wire data, to rebuild it from)."""
    data = task.data
    return {"id": str(data.id if data.id is not None else data.idx), "prompt": data.prompt_text,
            "answer": str(getattr(data, "answer", "") or ""), "vf_task": data.model_dump(mode="json")}


def single_agent(env) -> bool:
    """Whether `env` is verifiers' single-turn SingleAgentEnv (not a module's Env with its own run())."""
    from verifiers.v1.envs.single_agent.env import SingleAgentEnv

    return isinstance(env, SingleAgentEnv)


def episode_class(env_cfg) -> type:
    """A class of the episode protocol (app/envs.py) over `env_cfg`'s verifiers environment. VerifiersError when
    the environment declares more than one seat (only one is trained; see VerifiersEpisode)."""
    env = load(env_cfg)
    seats = list(env._agent_specs)  # verifiers 0.4.0 keeps the seats on the Env (pinned by the envs extra)
    if len(seats) != 1:
        raise VerifiersError(f"env.verifiers: {env_cfg.verifiers!r}: {type(env).__name__} declares the seats "
                             f"{seats}; only environments with one seat (the trained policy) run here")
    return type("VerifiersEpisode", (VerifiersEpisode,), {"env": env, "max_turns": env_cfg.max_turns,
                                                          "__module__": __name__})


def first_prompt(env_cfg, row: dict) -> list[dict]:
    """The opening messages of `row`'s episode (start-up check): run() is started and cancelled at its first turn."""
    import asyncio

    async def opening():
        episode = episode_class(env_cfg)(row)
        try:
            return await episode.reset()
        finally:
            await episode.close()

    try:
        return asyncio.run(opening())
    except Exception as e:
        raise VerifiersError(f"env.verifiers: {env_cfg.verifiers!r}: the first task's episode failed to start: "
                             f"{type(e).__name__}: {e}") from None


class VerifiersEpisode:
    """One task of a verifiers environment as an episode (app/verifiers_bridge.py): the environment's own
    `run(task, agents)` plays it, each turn() of its seat sampled by the episode loop. `reset()` starts run() and
    returns the first turn's messages (the task's prompt as its harness places it); `step(reply)` answers that
    turn and returns when run() asks for the next one (its new messages are the observations) or has finished
    (done; the reward is the trace's weighted reward after `Task.score`, `reward_parts` each reward's score).
    The seat's `max_turns` (env.max_turns, or the seat's own if lower) ends the exchange: the next turn() gets a
    terminated Segment. `close()` (the episode loop calls it in any case) cancels a run() still going."""

    env = None  # the verifiers Env, set by episode_class
    max_turns = 1

    def __init__(self, row: dict):
        from app.verifiers_bridge import Bridge

        env = self.env
        task_cls = type(env.taskset).task_type()
        self.task = task_cls(task_cls.data_type().model_validate(row["vf_task"]), env.taskset.config.task)
        (seat, agent_config), = env._agent_specs.items()
        max_turns = min(self.max_turns, agent_config.max_turns or self.max_turns)
        self.bridge = Bridge(env, self.task, seat=seat, harness=env._harnesses[seat], agent_config=agent_config,
                             max_turns=max_turns)
        self.reward_parts: dict[str, float] = {}
        self.truncated = False

    async def reset(self) -> list[dict]:
        from app.verifiers_bridge import RunFailed

        self.bridge.start()
        event = await self.bridge.next_event()
        if event.kind != "turn":
            raise RunFailed(f"{type(self.env).__name__}.run() finished without a turn")
        return _wire(event.messages)

    async def step(self, assistant_text: str) -> dict:
        self.bridge.reply(assistant_text)
        event = await self.bridge.next_event()
        if event.kind == "turn":
            return {"observations": _wire(event.messages), "reward": None, "done": False}
        trace = event.trace
        self.reward_parts = {name: float(r.score) for name, r in trace.rewards.items() if r is not None}
        self.truncated = trace.stop_condition == "max_turns"
        return {"observations": [], "reward": float(trace.reward), "done": True}

    async def close(self) -> None:
        await self.bridge.close()


def _wire(messages) -> list[dict]:
    """verifiers messages as the episode protocol's chat messages."""
    from verifiers.v1.types import content_text

    return [{"role": m.role, "content": content_text(m.content)} for m in messages]
