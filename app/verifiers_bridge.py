"""A verifiers environment's own `Env.run(task, agents)` driven turn by turn by the project's episode loop.

verifiers runs an episode as `env.setup(agents)`, `env.run(task, agents)`, `env.finalize(task, episode)`; inside
run() the environment holds the control flow (`async with agents.player.interaction(task) as i: segment = await
i.turn(); ... await i.turn(feedback)`), and each turn() would run a harness program against an interception
server. Here the project's episode loop (app/episodes.run_episode) holds the control flow and samples every turn
token-exactly, so the two are joined by inverting control: run() goes on as an asyncio task, and each turn() of
the trained seat hands its new messages to the episode loop (`next_event()`: a turn request) and waits for the
reply the loop sampled (`reply()`). The reply is committed into a real verifiers `Trace` through verifiers' own
turn graph; leaving the interaction scores the trace with `Task.score`, so `record_reward` in run(), the rubric
and `finalize` work as they do in verifiers.

Not run: harness programs, tools through MCP, sandboxes, `@stop` hooks, a second seat (refused at load time).
"""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from app.envs import EnvError


class RunFailed(EnvError):
    """The environment's setup(), run() or finalize() raised, or ran no turn: its episode fails."""


@dataclass
class Event:
    """What the episode loop waits for: `turn` (run() asks the model for a reply to `messages`, the new messages
    since the last reply) or `done` (run() and finalize() finished; `trace` is the scored seat's trace)."""

    kind: str
    messages: list | None = None
    trace: object | None = None


class Bridge:
    """One episode of `env` on `task`: start() runs setup/run/finalize as a task; next_event() waits for the
    next turn request or the end; reply(text) answers the pending turn; close() cancels whatever still runs."""

    def __init__(self, env, task, *, seat: str, harness, agent_config, max_turns: int):
        self.env, self.task, self.seat = env, task, seat
        self.harness, self.agent_config, self.max_turns = harness, agent_config, max_turns
        self.turns = 0  # replies committed
        self.trace = None  # the trained seat's trace, once its interaction opened
        self._events: asyncio.Queue[Event | BaseException] = asyncio.Queue()
        self._reply: asyncio.Future | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._drive(), name=f"verifiers-{self.seat}")

    async def next_event(self) -> Event:
        """The next turn request or the end; RunFailed when the environment raised."""
        event = await self._events.get()
        if isinstance(event, BaseException):
            raise event
        return event

    def reply(self, text: str) -> None:
        """Answer the pending turn request with the sampled reply."""
        if self._reply is None or self._reply.done():
            raise RuntimeError("no turn is waiting for a reply")
        self._reply.set_result(text)

    async def close(self) -> None:
        """Cancel run() if it still runs (an episode truncated, failed or abandoned) and wait until it is gone."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])

    async def _drive(self) -> None:
        from verifiers.v1.episode import EnvInfo, Episode
        from verifiers.v1.trace import TraceTask

        env, task = self.env, self.task
        name = type(env).__name__
        agents = Agents(self)
        stage = "setup"
        try:
            await env.setup(agents)
            stage = "run"
            await env.run(task, agents)
            if self.trace is None:
                raise RunFailed(f"{name}.run() ran no turn of its {self.seat!r} seat")
            stage = "finalize"
            episode = Episode(env=EnvInfo(id=env.config.env_id), traces=[self.trace],
                              task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash))
            await env.finalize(task, episode)
        except asyncio.CancelledError:
            raise
        except RunFailed as e:
            self._events.put_nowait(e)
            return
        except Exception as e:
            self._events.put_nowait(RunFailed(f"{name}.{stage}() raised {type(e).__name__}: {e}"))
            return
        self._events.put_nowait(Event("done", trace=self.trace))

    async def ask(self, messages: list) -> str:
        """One model turn for `messages` (the new ones): the episode loop samples it; the reply's text."""
        self._reply = asyncio.get_running_loop().create_future()
        self._events.put_nowait(Event("turn", messages=messages))
        return await self._reply


class Agents:
    """What run() gets as `agents`: the trained seat by its name; another name is an AttributeError naming it."""

    def __init__(self, bridge: Bridge):
        self._seat = Seat(bridge)

    def __getattr__(self, name: str):
        seat = self.__dict__.get("_seat")  # not through getattr: a copy without __init__ must not recurse
        if seat is None or name != seat.name:
            raise AttributeError(f"no agent {name!r}; this environment's seat is {getattr(seat, 'name', None)!r}")
        return seat


class Seat:
    """The trained seat: `interaction(task)` (the multi-turn surface) and `run(task)` (one turn, as
    SingleAgentEnv plays it). `trainable` is accepted from setup() but the seat is always trained."""

    def __init__(self, bridge: Bridge):
        self.bridge, self.name, self.trainable = bridge, bridge.seat, True

    @contextlib.asynccontextmanager
    async def interaction(self, task=None, **_resources):
        interaction = Interaction(self.bridge, task if task is not None else self.bridge.task)
        try:
            yield interaction
        except BaseException:
            interaction.closed = True  # failed or cancelled: not scored, the episode fails
            raise
        await interaction.close()

    async def run(self, task=None, **_resources):
        async with self.interaction(task) as interaction:
            await interaction.turn()
        return interaction.trace


class Interaction:
    """One exchange of the trained seat: `turn(message=None)` is one model turn sampled by the episode loop,
    returning a verifiers `Segment`; `trace` is the live verifiers Trace; leaving the context scores it."""

    def __init__(self, bridge: Bridge, task):
        from verifiers.v1.trace import AgentInfo, Trace, TraceTask

        if bridge.trace is not None:
            raise RuntimeError(f"the {bridge.seat!r} seat plays one interaction per episode")
        self.bridge, self.task, self.closed, self._over = bridge, task, False, False
        self.messages: list = []  # the conversation so far, as the trace's prompt of the next turn
        self.trace = bridge.trace = Trace(
            task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            agent=AgentInfo(config=bridge.agent_config, name=bridge.seat))

    async def turn(self, message=None):
        from verifiers.v1.agent import Segment
        from verifiers.v1.graph import prepare_turn
        from verifiers.v1.types import AssistantMessage, Response, TurnTokens, Usage

        if self.closed or self._over:
            raise RuntimeError("the exchange is over (the run ended); read interaction.trace")
        new = self._opening(message) if not self.messages else self._user(message)
        bridge = self.bridge
        if bridge.turns >= bridge.max_turns:  # verifiers' max_turns limit: the message goes unconsumed
            self._over = True
            self.trace.stop("max_turns")
            return Segment(messages=[], terminated=True)
        prompt = self.messages + new
        reply = await bridge.ask(new)
        response = Response(id=f"turn-{bridge.turns + 1}", created=0, model="policy", finish_reason="stop",
                            message=AssistantMessage(content=reply), usage=Usage(prompt_tokens=0, completion_tokens=0),
                            tokens=TurnTokens(prompt_ids=[], completion_ids=[], completion_logprobs=[]))
        prepare_turn(self.trace, prompt, []).commit(response)
        bridge.turns += 1
        self.messages = prompt + [response.message]
        return Segment(messages=[response.message], root_reply=self.trace.root_reply)

    def _opening(self, message) -> list:
        """The first turn's messages: the task's prompt as its harness places it (system prompt, then the prompt),
        or, for a prompt-less task, its system prompt and `message` (verifiers' rule: who speaks first)."""
        from verifiers.v1.types import SystemMessage, UserMessage

        data = self.task.data
        if data.prompt is not None and message is not None:
            raise ValueError("the task's prompt opens this exchange: take its first reply with a bare turn()")
        if data.prompt is None and message is None:
            raise ValueError("a prompt-less task is opened by turn(message)")
        if data.prompt is None:
            system = data.system_prompt
            return ([SystemMessage(content=system)] if system else []) + self._user(message)
        system, prompt = self.bridge.harness.resolve_prompt(data)
        messages = [SystemMessage(content=system)] if system else []
        messages += [UserMessage(content=prompt)] if isinstance(prompt, str) else list(prompt or [])
        if not messages:
            raise ValueError(f"task {data.id or data.idx} has no prompt")
        return messages

    @staticmethod
    def _user(message) -> list:
        from verifiers.v1.dialects import parse_message
        from verifiers.v1.types import UserMessage

        if message is None:
            raise ValueError("nothing to run a turn on: this exchange takes its next user message")
        if isinstance(message, str):
            return [UserMessage(content=message)]
        return [parse_message(m) if isinstance(m, dict) else m for m in message]

    async def close(self):
        """End the exchange and score the trace with the task's rubric (idempotent), as verifiers' Rollout.close."""
        if self.closed:
            return self.trace
        self.closed = True
        self.trace.stop("user_closed")
        await self.task.score(self.trace)
        self.trace.is_completed = self.trace.ok = True
        return self.trace
