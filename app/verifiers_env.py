"""verifiers environments as the run's episodes (`env.verifiers: ID`, `env.args: {...}`; docs/VERIFIERS.md).

The environment is loaded the way verifiers loads it (`verifiers.v1.resolve_env_config` +
`load_environment` with `taskset={"id": ID, **args}`): the module named ID exports one `Taskset`, whose
tasks become the run's data rows (each row carries its task's wire data, so a worker rebuilds the task
without the taskset), and whose `Task` class holds the rubric (`@vf.reward` functions and their weights).
Each episode is one `VerifiersEpisode(row)` behind the project's episode protocol (app/envs.py), so it is
sampled token-exactly under the group's pinned version (app/episodes.py); its reply is committed into a
verifiers `Trace` (its own turn graph) and scored by `Task.score`: the weighted sum of the rewards is the
GRPO reward, each function's score goes to the step metrics as `reward/NAME`.

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
        data = task.data
        rows.append({"id": str(data.id if data.id is not None else data.idx), "prompt": data.prompt_text,
                     "answer": str(getattr(data, "answer", "") or ""),
                     "vf_task": data.model_dump(mode="json")})
        if len(rows) == 1 and not reward_names(task):
            raise VerifiersError(f"env.verifiers: {env_cfg.verifiers!r}: its task {type(task).__name__} has no "
                                 "@vf.reward function (no rubric to train on)")
    if not rows:
        raise VerifiersError(f"env.verifiers: {env_cfg.verifiers!r}: its taskset "
                             f"{type(env.taskset).__name__} yielded no tasks (no dataset to train on)")
    return rows


def episode_class(env_cfg) -> type:
    """A class of the episode protocol (app/envs.py) over `env_cfg`'s verifiers environment."""
    env = load(env_cfg)
    return type("VerifiersEpisode", (VerifiersEpisode,), {"env": env, "__module__": __name__})


class VerifiersEpisode:
    """One task of a verifiers environment as an episode: `reset()` is the task's prompt as its harness
    places it (system prompt, then the prompt text or messages), `step(reply)` commits the reply into a
    verifiers Trace and scores it with the task's rubric. Single-turn: the episode is done after one reply.
    `reward_parts` holds each reward function's score after the step."""

    env = None  # the verifiers Env, set by episode_class

    def __init__(self, row: dict):
        env = self.env
        task_cls = type(env.taskset).task_type()
        # The seat's harness and agent config: verifiers 0.4.0 keeps them on the Env (pinned by the envs extra).
        self.task = task_cls(task_cls.data_type().model_validate(row["vf_task"]), env.taskset.config.task)
        self.harness = env._harnesses.get("agent") or next(iter(env._harnesses.values()))
        self.agent_config = env._agent_specs.get("agent") or next(iter(env._agent_specs.values()))
        self.prompt = self._prompt_messages()
        self.reward_parts: dict[str, float] = {}

    def _prompt_messages(self) -> list:
        from verifiers.v1.types import SystemMessage, UserMessage

        system, prompt = self.harness.resolve_prompt(self.task.data)
        messages = [SystemMessage(content=system)] if system else []
        if isinstance(prompt, str):
            messages.append(UserMessage(content=prompt))
        elif prompt:
            messages += list(prompt)
        if not messages:
            raise VerifiersError(f"env.verifiers: task {self.task.data.id or self.task.data.idx} has no prompt")
        return messages

    def reset(self) -> list[dict]:
        from verifiers.v1.types import content_text

        return [{"role": m.role, "content": content_text(m.content)} for m in self.prompt]

    async def step(self, assistant_text: str) -> dict:
        trace = self._trace(assistant_text)
        await self.task.score(trace)
        self.reward_parts = {name: float(r.score) for name, r in trace.rewards.items() if r is not None}
        return {"observations": [], "reward": float(trace.reward), "done": True}

    def _trace(self, reply: str):
        """A verifiers Trace holding the prompt and the reply, committed through its own turn graph."""
        from verifiers.v1.graph import prepare_turn
        from verifiers.v1.trace import AgentInfo, Trace, TraceTask
        from verifiers.v1.types import AssistantMessage, Response, TurnTokens, Usage

        task = self.task
        trace = Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                      agent=AgentInfo(config=self.agent_config))
        response = Response(id="", created=0, model="policy", message=AssistantMessage(content=reply),
                            finish_reason="stop", usage=Usage(prompt_tokens=0, completion_tokens=0),
                            tokens=TurnTokens(prompt_ids=[], completion_ids=[], completion_logprobs=[]))
        prepare_turn(trace, self.prompt, []).commit(response)
        trace.is_completed = trace.ok = True
        return trace
