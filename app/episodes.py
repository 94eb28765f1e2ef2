"""One multi-turn episode: the environment and the served policy take turns until the environment says
done, `env.max_turns` is reached, or the next turn would pass `env.max_episode_tokens` (truncated).

- Every turn is sampled under the version pinned when the episode's group started, on the replica that
  served the previous turn (its KV cache holds the conversation: `generate(..., replica=...)`). With
  rollout.partial a turn is the unit that moves: a turn may move to newer versions while it generates, and
  the next turn starts under the version the previous one ended under; the episode keeps per-token
  provenance (`token_versions`, context tokens taking the version of the turn after them).
- The conversation grows token by token (app/chat_tokens.py): the tokens the trainer gets are exactly the
  ones the engine saw and produced, turn by turn; `mask` is 1 on sampled tokens only.
- The environment's calls are checked and bounded (app/envs.py); any failure is EnvError, which loses
  only this episode's group.
Tool use is counted from the observations: each `tool` message is one call, and one whose content starts
with "error:" (app/tools.ToolBox's error observations) one tool error.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field

from app.chat_tokens import ChatTokens
from app.envs import EnvError, call, check_messages, check_step
from common.types import add_segment

# generate(prompt_ids, max_tokens, replica[, version]) -> the replica's result dict for one sample; `version`
# (partial rollouts only): the version the turn starts under
Generate = Callable[..., Awaitable[dict]]


@dataclass
class EpisodeStats:
    turns: int = 0
    truncated: bool = False
    tool_calls: int = 0
    tool_errors: int = 0
    env_tokens: int = 0  # context tokens the environment added between turns
    sampled_tokens: int = 0
    prefix_hits: list[float] = field(default_factory=list)  # per turn: prompt tokens found cached / prompt tokens
    rewards: dict[str, float] = field(default_factory=dict)  # the environment's reward parts (reward/NAME)
    retokenized_turns: int = 0  # turns whose prompt did not extend the turn before (app/token_continuity.py)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Episode:
    prompt_ids: list[int]  # the opening prompt
    completion_ids: list[int] = field(default_factory=list)  # every token after it
    mask: list[int] = field(default_factory=list)  # 1 sampled, 0 environment context
    # behaviour logprobs, 0.0 on context; None once a turn came without them (rollout.behaviour_logprobs
    # trainer: the trainer scores the whole episode under its version)
    logprobs: list[float] | None = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    step_rewards: list[float | None] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)  # per turn: what the engine saw and produced
    version: int | None = None
    stats: EpisodeStats = field(default_factory=EpisodeStats)
    token_versions: list[list[int]] | None = None  # partial rollouts: run-length versions over completion_ids
    resumed: int = 0
    regenerated_tokens: int = 0
    _pending_context: int = 0  # context tokens whose version is the next turn's

    def partial_fields(self) -> dict:
        """Sample fields of a partial episode ({} otherwise); context after the last turn takes its version."""
        if self.token_versions is None:
            return {}
        segs = [list(seg) for seg in self.token_versions]
        add_segment(segs, segs[-1][0] if segs else int(self.version or 0), self._pending_context)
        return {"token_versions": segs, "resumed": self.resumed, "regenerated_tokens": self.regenerated_tokens}

    @property
    def last_version(self) -> int | None:
        return int(self.token_versions[-1][0]) if self.token_versions else self.version

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    @property
    def last_text(self) -> str:
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "assistant"), "")

    def add_turn(self, out: dict) -> None:
        tokens, logprobs = list(out["token_ids"]), list(out["logprobs"])
        if not logprobs and tokens:  # sampled without logprobs: the trainer computes them all
            self.logprobs = None
        elif len(logprobs) != len(tokens):
            raise RuntimeError(f"turn {len(self.turns) + 1}: {len(tokens)} tokens but {len(logprobs)} logprobs")
        self.turns.append({"prompt_ids": list(out["prompt_token_ids"]), "token_ids": tokens,
                           "replica_id": out.get("replica_id"), "version": int(out["version"]),
                           "sha256": out.get("sha256"), "finish_reason": out.get("finish_reason")})
        if "version_sha256" in out:  # a partial turn: the worker checks every version it ran under, not just one
            self.turns[-1]["version_sha256"] = dict(out["version_sha256"])
        if "versions" in out:
            segs = self.token_versions = self.token_versions or []
            first = int(out["versions"][0][0]) if out["versions"] else int(out["version"])
            add_segment(segs, first, self._pending_context)
            self._pending_context = 0
            for v, n in out["versions"]:
                add_segment(segs, int(v), int(n))
            self.resumed += int(out.get("resumed", 0))
            self.regenerated_tokens += int(out.get("regenerated_tokens", 0))
        self.completion_ids += tokens
        self.mask += [1] * len(tokens)
        if self.logprobs is not None:
            self.logprobs += logprobs
        self.finish_reasons.append(out.get("finish_reason"))
        self.messages.append({"role": "assistant", "content": out["text"]})
        st = self.stats
        st.turns += 1
        st.sampled_tokens += len(tokens)
        st.prefix_hits.append(int(out.get("cached_tokens") or 0) / max(1, len(out["prompt_token_ids"])))

    def add_context(self, tokens: list[int], observations: list[dict]) -> None:
        self._pending_context += len(tokens)
        self.completion_ids += tokens
        self.mask += [0] * len(tokens)
        if self.logprobs is not None:
            self.logprobs += [0.0] * len(tokens)
        self.messages += observations
        self.stats.env_tokens += len(tokens)
        for m in observations:
            if m["role"] == "tool":
                self.stats.tool_calls += 1
                self.stats.tool_errors += int(m["content"].lstrip().startswith("error:"))


async def run_episode(env, chat: ChatTokens, generate: Generate, *, max_turns: int, max_tokens_per_turn: int,
                      max_episode_tokens: int, timeout_s: float) -> Episode:
    """Play one episode of `env` (module docstring). Raises EnvError when the environment fails. An environment's
    optional `close()` is awaited however the episode ends (done, truncated, failed or cancelled)."""
    try:
        return await _play(env, chat, generate, max_turns=max_turns, max_tokens_per_turn=max_tokens_per_turn,
                           max_episode_tokens=max_episode_tokens, timeout_s=timeout_s)
    finally:
        if callable(getattr(env, "close", None)):
            await _env_call(env.close, timeout_s=timeout_s, where=f"{type(env).__name__}.close()")


async def _play(env, chat: ChatTokens, generate: Generate, *, max_turns: int, max_tokens_per_turn: int,
                max_episode_tokens: int, timeout_s: float) -> Episode:
    name = type(env).__name__
    opening = check_messages(await _env_call(env.reset, timeout_s=timeout_s, where=f"{name}.reset()"),
                             f"{name}.reset()")
    ep = Episode(prompt_ids=chat.opening(opening), messages=list(opening))
    if len(ep.prompt_ids) >= max_episode_tokens:
        raise EnvError(f"{name}.reset(): the opening messages are {len(ep.prompt_ids)} tokens; an episode may hold "
                       f"{max_episode_tokens} (env.max_episode_tokens / model.max_model_len)")
    replica = None
    for turn in range(1, max_turns + 1):
        budget = min(max_tokens_per_turn, max_episode_tokens - len(ep.ids))
        if ep.token_versions is not None:  # partial: on from the version the previous turn ended under
            out = await generate(ep.ids, budget, replica, ep.last_version)
        else:
            out = await generate(ep.ids, budget, replica)
        partial = "versions" in out  # a partial turn's versions are per token; the episode keeps its first
        if not partial and ep.version is not None and int(out["version"]) != ep.version:  # the ingress pins
            raise RuntimeError(f"episode turn {turn} sampled under policy-v{out['version']}, "
                               f"the episode under policy-v{ep.version}")
        if ep.version is None or not partial:
            ep.version = int(out["version"])
        replica = out.get("replica_id")
        ep.add_turn(out)
        result = check_step(await _env_call(env.step, out["text"], timeout_s=timeout_s, where=f"{name}.step()"),
                            f"{name}.step()")
        ep.step_rewards.append(result.reward)
        if result.done:
            return _checked(ep, env)
        if turn == max_turns:
            break
        context = chat.after_turn(out["token_ids"], result.observations)
        if len(ep.ids) + len(context) >= max_episode_tokens:  # no room left for a sampled token
            break
        ep.add_context(context, result.observations)
    ep.stats.truncated = True
    return _checked(ep, env)


def _checked(ep: Episode, env) -> Episode:
    """The environment's reward parts on the stats; an episode with a re-tokenized turn keeps no trained token
    (its ids are not what the engine saw)."""
    from app.token_continuity import retokenized_turns

    ep.stats.rewards = {str(k): float(v) for k, v in (getattr(env, "reward_parts", None) or {}).items()}
    ep.stats.truncated = ep.stats.truncated or bool(getattr(env, "truncated", False))  # ended by its own limit
    ep.stats.retokenized_turns = len(retokenized_turns(ep.turns))
    if ep.stats.retokenized_turns:
        ep.mask = [0] * len(ep.mask)
    return ep


async def _env_call(fn, *args, timeout_s: float, where: str):
    try:
        return await call(fn, *args, timeout_s=timeout_s)
    except EnvError:
        raise
    except Exception as e:
        raise EnvError(f"{where} raised {type(e).__name__}: {e}") from e


class EpisodeRollout:
    """What the rollout workers and the evaluator share: the environment class, one ChatTokens per tool
    set, and the episode's reward (the sum of its step rewards, or reward.fn over the trajectory)."""

    def __init__(self, cfg, tokenizer, scorer=None):
        from app.envs import load_env

        if cfg.env.verifiers is not None:
            from app.verifiers_env import episode_class

            self.env_cls = episode_class(cfg.env)
        else:
            self.env_cls = load_env(cfg.env.cls)
        self.env_cfg = cfg.env
        self.max_tokens_per_turn = cfg.grpo.max_new_tokens
        self.max_episode_tokens = cfg.env.max_episode_tokens or cfg.model.max_model_len
        self.tokenizer = tokenizer
        self.scorer = scorer  # app.rewards.Scorer, or None: step rewards
        self._chats: dict[str, ChatTokens] = {}

    def _chat(self, env) -> ChatTokens:
        import json

        tools = getattr(env, "tools", None)
        key = json.dumps(tools, sort_keys=True, default=str)
        if key not in self._chats:
            self._chats[key] = ChatTokens(self.tokenizer, tools=tools)
        return self._chats[key]

    async def play(self, row: dict, generate: Generate) -> Episode:
        try:
            env = self.env_cls(row)
        except Exception as e:
            raise EnvError(f"{self.env_cls.__name__}(row) raised {type(e).__name__}: {e}") from e
        return await run_episode(env, self._chat(env), generate, max_turns=self.env_cfg.max_turns,
                                 max_tokens_per_turn=self.max_tokens_per_turn,
                                 max_episode_tokens=self.max_episode_tokens, timeout_s=self.env_cfg.step_timeout_s)

    def reward(self, ep: Episode, row: dict) -> float:
        if self.scorer is None:
            return float(sum(r for r in ep.step_rewards if r is not None))
        trajectory = {"messages": ep.messages, "finish_reasons": ep.finish_reasons, "step_rewards": ep.step_rewards,
                      "truncated": ep.stats.truncated}
        return float(self.scorer(ep.last_text, row, ep.finish_reasons[-1] if ep.finish_reasons else None,
                                 trajectory=trajectory))
