"""Multi-turn episodes without an engine: the token-exact chat suffixes on the tiny model's real
tokenizer and template, the environment checks, the episode loop (ends, truncation, failures), the
masked trainer batch and the per-step episode metrics, the session rule of the router. The episode loop
gets its turns from a scripted `generate` here (a stand-in for the ingress, so every end and failure can
be forced); tests/test_multiturn.py plays the same episodes through real vLLM replicas."""
from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from app.chat_tokens import ChatTokens
from app.envs import EnvError, check_env, check_step, load_env
from app.episodes import EpisodeRollout, run_episode
from common import config as C
from common.types import Group, Sample
from serve_deployments.request_router import RoutingPolicy
from train_loops.batches import StepBatch, collate


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_appended_turns_equal_the_template_of_the_whole_conversation(tok):
    """When the model's tokens are what the template would write (the reply's text + EOS), the appended
    prompt is exactly the template's rendering of the whole conversation: nothing is re-tokenized, and
    nothing is lost at the turn boundaries."""
    chat = ChatTokens(tok)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Guess: K, Q or Z."}]
    ids = chat.opening(msgs)
    assert ids == tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    for reply, obs in [("K", [{"role": "user", "content": "wrong. say Q."}]),
                       ("Q", [{"role": "tool", "content": "42"}, {"role": "user", "content": "and?"}])]:
        sampled = _ids(tok, reply) + [tok.eos_token_id]
        ids = ids + sampled + chat.after_turn(sampled, obs)
        msgs = msgs + [{"role": "assistant", "content": reply}] + obs
        assert ids == tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)


def test_turn_cut_at_max_tokens_gets_the_whole_end_of_turn(tok):
    chat = ChatTokens(tok)
    assert chat.turn_close_text == "<|im_end|>\n"
    assert chat.turn_close(_ids(tok, "KQ")) == _ids(tok, "<|im_end|>\n")  # no EOS sampled: all of it
    assert chat.turn_close(_ids(tok, "K") + [tok.eos_token_id]) == _ids(tok, "\n")


# Long enough that the opening fills a KV block of the CPU engine (128 tokens): later turns can hit the cache.
SYSTEM = "You play a guessing game. Answer with one capital letter and nothing else. " * 2


class Feedback:
    """Three turns: feedback twice, done on the third; reward 1 on a turn whose text holds the row's answer."""

    def __init__(self, row):
        self.answer, self.turn = row["answer"], 0

    def reset(self):
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": row_prompt(self.answer)}]

    async def step(self, text):
        self.turn += 1
        hit = float(self.answer in text)
        if self.turn == 3:
            return {"observations": [], "reward": hit, "done": True}
        return {"observations": [{"role": "user", "content": f"try {self.turn}"}], "reward": hit, "done": False}


def row_prompt(answer):
    return f"Say {answer}."


def scripted(tok, replies: list[str], replica="r0", cached=3):
    """A stand-in for the ingress: answers turn k with replies[k] (+ EOS), logprob -0.5 per token."""
    seen = []

    async def generate(ids, max_tokens, replica_hint):
        seen.append({"ids": list(ids), "max_tokens": max_tokens, "replica": replica_hint})
        text = replies[len(seen) - 1]
        toks = (_ids(tok, text) + [tok.eos_token_id])[:max_tokens]
        return {"token_ids": toks, "logprobs": [-0.5] * len(toks), "text": text, "finish_reason": "stop",
                "version": 3, "prompt_token_ids": list(ids), "replica_id": replica, "sha256": "s",
                "cached_tokens": cached}

    return generate, seen


def _play(tok, env, replies, **kw):
    generate, seen = scripted(tok, replies)
    opts = {"max_turns": 4, "max_tokens_per_turn": 4, "max_episode_tokens": 512, "timeout_s": 5.0, **kw}
    return asyncio.run(run_episode(env, ChatTokens(tok), generate, **opts)), seen


def test_three_turn_episode_is_token_exact_and_masked(tok):
    ep, seen = _play(tok, Feedback({"answer": "Q"}), ["K", "Z", "Q"])
    assert ep.stats.turns == 3 and not ep.stats.truncated and ep.step_rewards == [0.0, 0.0, 1.0]
    assert [s["replica"] for s in seen] == [None, "r0", "r0"]  # turns 2 and 3: the previous turn's replica
    for k in range(1, 3):  # each prompt: the previous prompt + what was sampled + the context between
        prev = ep.turns[k - 1]
        context = ChatTokens(tok).after_turn(prev["token_ids"], [{"role": "user", "content": f"try {k}"}])
        assert seen[k]["ids"] == prev["prompt_ids"] + prev["token_ids"] + context
    assert ep.ids == ep.turns[-1]["prompt_ids"] + ep.turns[-1]["token_ids"]
    sampled = [t for turn in ep.turns for t in turn["token_ids"]]
    assert [t for t, m in zip(ep.completion_ids, ep.mask) if m] == sampled
    assert sum(ep.mask) == ep.stats.sampled_tokens == len(sampled)
    assert ep.stats.env_tokens == len(ep.mask) - sum(ep.mask) > 0
    assert ep.logprobs == [-0.5 if m else 0.0 for m in ep.mask]
    # the trainer's batch: input ids are the episode's, the loss mask covers the sampled tokens only
    s = Sample(ep.prompt_ids, ep.completion_ids, ep.logprobs, 1.0, 0.5, 3, completion_mask=ep.mask,
               episode=ep.stats.to_dict())
    b = collate([s])
    assert b["input_ids"][0].tolist() == ep.ids
    assert b["targets"][0][b["mask"][0]].tolist() == sampled
    assert s.sampled_tokens == len(sampled)


def test_episode_ends_at_max_turns_or_token_budget_as_truncated(tok):
    ep, _ = _play(tok, Feedback({"answer": "Q"}), ["K", "Z"], max_turns=2)
    assert ep.stats.turns == 2 and ep.stats.truncated
    ep, seen = _play(tok, Feedback({"answer": "Q"}), ["K", "Z", "Q"], max_episode_tokens=220)
    assert ep.stats.truncated and ep.stats.turns == 2 and len(ep.ids) < 220
    assert all(len(s["ids"]) + s["max_tokens"] <= 220 for s in seen)  # no turn may run past the budget


class Broken:
    def __init__(self, row):
        self.mode = row["mode"]

    def reset(self):
        return "hello" if self.mode == "reset-shape" else [{"role": "user", "content": "hi"}]

    def step(self, text):
        if self.mode == "raise":
            raise KeyError("boom")
        if self.mode == "obs-shape":
            return {"observations": ["not a message"], "reward": 0.0, "done": False}
        if self.mode == "slow":
            import time

            time.sleep(2)
        return {"observations": [], "reward": float("nan"), "done": True}


@pytest.mark.parametrize("mode,match", [("reset-shape", "must return a list of messages"),
                                        ("raise", "raised KeyError"),
                                        ("obs-shape", "not a {role, content} chat message"),
                                        ("slow", "took longer than env.step_timeout_s"),
                                        ("nan", "finite number")])
def test_environment_failures_are_episode_errors_naming_the_problem(tok, mode, match):
    with pytest.raises(EnvError, match=match):
        _play(tok, Broken({"mode": mode}), ["K"], timeout_s=0.5)


def test_check_step_shapes():
    assert check_step({"observations": [], "reward": 1, "done": True}, "e").reward == 1.0
    assert check_step({"done": False}, "e").observations == []
    for bad, match in [([], "must return a dict"), ({"done": 1}, "done must be a bool"),
                       ({"rewards": 1}, "unknown keys"), ({"reward": True}, "finite number")]:
        with pytest.raises(EnvError, match=match):
            check_step(bad, "e")


def test_env_class_is_checked_before_anything_starts():
    with pytest.raises(ValueError, match="cannot import module"):
        load_env("no_such_module_xyz:Env")
    with pytest.raises(ValueError, match="lacks reset and step"):
        load_env("common.types:Sample")
    with pytest.raises(ValueError, match="must return a list of messages"):
        check_env("tests.test_episodes:Broken", {"id": "1", "mode": "reset-shape"})
    with pytest.raises(ValueError, match="failed on data row '1'"):
        check_env("app.builtin_envs:LetterHunt", {"id": "1", "prompt": "Guess my letter.", "answer": "K"})
    check_env("app.builtin_envs:LetterHunt", {"id": "1", "prompt": "Guess my letter.", "answer": "Q",
                                               "distractors": "KZ"})


def test_letter_hunt_rewards_and_reward_fn_over_the_trajectory(tok, tiny_model_dir):
    from app.builtin_envs import LetterHunt
    from app.rewards import scorer_for

    row = {"id": "h", "prompt": "Guess my letter.", "answer": "Q", "distractors": "KZ"}
    env = LetterHunt(row)
    first = env.step("K")
    assert first["reward"] == 0.0 and not first["done"]
    assert first["observations"][0]["content"] == "wrong. say the letter Q, not K or Z."
    assert env.step("Q") == {"observations": [], "reward": 1.0, "done": True}
    cfg = C.load("recipes/tiny-multiturn.yaml", [f"model.path={tiny_model_dir}"])
    summed = EpisodeRollout(cfg, tok)
    ep, _ = asyncio.run(_episode(summed, row, ["Z", "Q"], tok))
    assert summed.reward(ep, row) == 1.0 and ep.stats.turns == 2

    def turns_used(completion, answer, prompt, trajectory):
        return float(completion == answer) / len(trajectory["finish_reasons"])

    fn_rollout = EpisodeRollout(cfg, tok, scorer_for(turns_used))
    assert fn_rollout.reward(ep, row) == 0.5


async def _episode(rollout, row, replies, tok):
    generate, seen = scripted(tok, replies)
    return await rollout.play(row, generate), seen


def test_step_metrics_of_episodes():
    def sample(turns, truncated, env_tokens, sampled, hits, tools=0, errors=0):
        ep = {"turns": turns, "truncated": truncated, "tool_calls": tools, "tool_errors": errors,
              "env_tokens": env_tokens, "sampled_tokens": sampled, "prefix_hits": hits}
        return Sample([1], [2] * (env_tokens + sampled), [0.0] * (env_tokens + sampled), 0.0, 0.0, 1, episode=ep)

    batch = StepBatch(groups=[Group([sample(1, False, 0, 2, [0.0]), sample(3, True, 6, 6, [0.0, 0.5, 1.0], 2, 1)],
                                    1, "p")])
    m = batch.episode_stats()
    assert m["episode_turns_mean"] == 2.0 and m["episode_truncated"] == 1
    assert m["tool_calls_mean"] == 1.0 and m["tool_errors"] == 1
    assert m["env_tokens_fraction"] == pytest.approx(6 / 14)
    assert m["prefix_hit_turn1"] == 0.0 and m["prefix_hit_turn2"] == 0.5 and m["prefix_hit_turn3"] == 1.0
    assert StepBatch(groups=[Group([Sample([1], [2], [0.0], 0.0, 0.0, 1)], 1, "p")]).episode_stats() == {}


def test_router_keeps_an_episode_on_its_replica():
    pol = RoutingPolicy("prefix", imbalance=1)
    pol.set_replicas(["a", "b"])
    first = pol.choose({"hashes": [1, 2, 3]}, "c1")
    other = "b" if first.replica == "a" else "a"
    # the session wins over the prefix owner, and over load, while its replica is a candidate
    d = pol.choose({"hashes": [1, 2, 3], "replica": other}, "c2")
    assert d.replica == other and d.kind == "session" and pol.counters["session"] == 1
    assert pol.choose({"hashes": [9], "replica": "gone"}, "c3").kind != "session"


def test_config_rules_for_episodes():
    with pytest.raises(C.ConfigError, match="reward.fn: null needs env.cls"):
        C.load("recipes/tiny-cpu.yaml", ["reward.fn=null"])
    with pytest.raises(C.ConfigError, match="env.max_turns"):
        C.load("recipes/tiny-multiturn.yaml", ["env.max_turns=0"])
    with pytest.raises(C.ConfigError, match="exceeds model.max_model_len"):
        C.load("recipes/tiny-multiturn.yaml", ["env.max_episode_tokens=9999"])
    with pytest.raises(C.ConfigError, match="is not `module:Class`"):
        C.load("recipes/tiny-multiturn.yaml", ["env.cls=LetterHunt"])
    with pytest.raises(C.ConfigError, match="reward.where: task runs single-turn rewards only"):
        C.load("recipes/tiny-multiturn.yaml", ["reward.where=task"])
    with pytest.raises(C.ConfigError, match="overlong penalty is for single-turn"):
        C.load("recipes/tiny-multiturn.yaml", ["grpo.dapo_overlong_buffer=2"])


def test_readme_environment_example_runs(tmp_path, monkeypatch, tok):
    """The README's "Multi-turn and tools" example, as written there: it loads, resets, calls its tool,
    and ends the episode; its tool schemas render through the chat template."""
    import re
    import sys
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text.split("## Multi-turn and tools", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert len(code.splitlines()) < 40
    (tmp_path / "readme_env.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    row = {"id": "r1", "prompt": "What is a ray?", "answer": "a line of light"}
    check_env("readme_env:DefineEnv", row)
    env = load_env("readme_env:DefineEnv")(row)
    call = '<tool_call>\n{"name": "lookup", "arguments": {"word": "ray"}}\n</tool_call>'
    first = asyncio.run(env.step(call))
    assert not first["done"] and first["observations"][0]["content"] == "a line of light"
    bad = asyncio.run(env.step('<tool_call>{"name": "lookup"}</tool_call>'))
    assert bad["observations"][0]["content"].startswith("error:")
    assert asyncio.run(env.step("It is a line of light.")) == {"observations": [], "reward": 1.0, "done": True}
    assert ChatTokens(tok, tools=env.tools).suffix([{"role": "user", "content": "x"}])
    sys.modules.pop("readme_env", None)
