"""verifiers environments as the run's episodes (app/verifiers_env.py): a third-party environment module
(tests/support/vf_letters_env.py, installed here by putting tests/support on the import path, the way a pip
package would be) loads through verifiers' own loader, its tasks become the prompts, its rubric scores the
episode (weighted sum, each function's score on the step metrics); a multi-turn environment (vf_steps_env: its own
Env.run() through app/verifiers_bridge.py) plays its turns through the episode loop, ends on max_turns, fails only
its episode when run() raises and leaves no run() behind; bad environments fail at validation; the
re-tokenization detector; and a short real run (Ray, Serve, vLLM, DeepSpeed) trains on the single-turn environment,
evaluating held-out tasks every step (eval.path: verifiers; the rest of its tests in tests/test_verifiers_eval.py).
The multi-turn environment's real run is tests/test_fleet.py's run a (3-turn episodes, token-exact turn by turn, the
rubric's two functions, step 1's trainer logprobs equal to the engine's), on a shared fleet: one run start less."""
from __future__ import annotations

import asyncio
import json
import math
import os
import sys
from pathlib import Path

import pytest
import yaml

from app.episodes import EpisodeRollout
from app.token_continuity import extends, retokenized_turns
from common import config as C
from common.types import Group, Sample
from tests._serve_helpers import LOGPROB_TOL, serve_env  # noqa: F401
from train_loops.batches import StepBatch

SUPPORT = str(Path(__file__).parent / "support")
ENV = {"verifiers": "vf_letters_env", "args": {"size": 16}}


@pytest.fixture(scope="module", autouse=True)
def support_importable():
    """tests/support importable here and, through PYTHONPATH, in the Ray workers this module's Ray starts."""
    old_path, old_env = list(sys.path), os.environ.get("PYTHONPATH")
    sys.path.insert(0, SUPPORT)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (SUPPORT, old_env) if p)
    yield
    sys.path[:] = old_path
    if old_env is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old_env


def vf_config(tiny_model_dir, tmp_path, **env):
    return C.load("recipes/verifiers-cpu.yaml", [f"model.path={tiny_model_dir}", "model.build_tiny=false",
                                                 f"run.out_dir={tmp_path}"]).replace(env=env or ENV)


def test_tasks_become_rows_and_the_rubric_scores_episodes(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from app.preflight import verifiers_prompts
    from tests.test_episodes import scripted

    cfg = vf_config(tiny_model_dir, tmp_path)
    rows = verifiers_prompts(cfg)
    assert len(rows) == 16 and rows[0]["id"] == "letters-0"
    assert rows[0]["prompt"].startswith(f"Say the letter {rows[0]['answer']}, not ")
    assert rows[3]["vf_task"]["answer"] == rows[3]["answer"] and rows[3]["vf_task"]["idx"] == 3
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rollout = EpisodeRollout(cfg, tok)
    row = rows[0]
    wrong = "Z" if row["answer"] != "Z" else "Y"
    episodes = []
    for reply, exact, starts in ((row["answer"], 1.0, 1.0), (f"{row['answer']}!", 0.0, 1.0), (wrong, 0.0, 0.0)):
        generate, seen = scripted(tok, [reply])
        ep = asyncio.run(rollout.play(row, generate))
        assert ep.stats.turns == 1 and ep.stats.retokenized_turns == 0
        # the prompt the engine saw is the chat template of the task's prompt; the trained ids are the engine's
        assert seen[0]["ids"] == tok.apply_chat_template([{"role": "user", "content": row["prompt"]}],
                                                         add_generation_prompt=True, return_dict=False)
        assert ep.ids == seen[0]["ids"] + ep.turns[0]["token_ids"] and ep.mask == [1] * len(ep.completion_ids)
        # exact_match weighs 1.0, starts_with_answer 0.0: the reward is the weighted sum, the parts are scores
        assert rollout.reward(ep, row) == exact
        assert ep.stats.rewards == {"exact_match": exact, "starts_with_answer": starts}
        episodes.append(ep)
    samples = [Sample(ep.prompt_ids, ep.completion_ids, ep.logprobs, 0.0, 0.0, 1, completion_mask=ep.mask,
                      episode=ep.stats.to_dict()) for ep in episodes]
    m = StepBatch(groups=[Group(samples, 1, row["id"])]).episode_stats()
    assert m["reward/exact_match"] == pytest.approx(1 / 3) and m["reward/starts_with_answer"] == pytest.approx(2 / 3)
    assert m["retokenized_turns"] == 0


STEPS = {"verifiers": "vf_steps_env", "args": {"size": 4, "turns": 3}}


def _steps(tiny_model_dir, tmp_path, **env):
    from transformers import AutoTokenizer

    from app.preflight import verifiers_prompts

    cfg = vf_config(tiny_model_dir, tmp_path, **{**STEPS, **env})
    return cfg, verifiers_prompts(cfg), AutoTokenizer.from_pretrained(tiny_model_dir)


def test_a_multi_turn_environment_plays_its_own_run(tiny_model_dir, tmp_path):
    """vf_steps_env's own Env.run() drives the exchange: each turn() is one sampled turn of the episode loop, its
    feedback reaches the next prompt as exactly the tokens the chat template adds, the rubric scores the trace."""
    from app.chat_tokens import ChatTokens
    from tests.test_episodes import scripted

    cfg, rows, tok = _steps(tiny_model_dir, tmp_path)
    row = rows[1]
    answers = row["vf_task"]["answers"]
    assert row["prompt"] == f"Say the letter {answers[0]}." and len(answers) == 3
    wrong = "Z" if answers[1] != "Z" else "Y"
    generate, seen = scripted(tok, [answers[0], wrong, answers[2]])
    rollout = EpisodeRollout(cfg, tok)
    ep = asyncio.run(rollout.play(row, generate))
    assert ep.stats.turns == 3 and not ep.stats.truncated and ep.stats.retokenized_turns == 0
    feedback = [f"Right. Now say the letter {answers[1]}.",
                f"No, it was {answers[1]}. Now say the letter {answers[2]}."]
    assert [m["content"] for m in ep.messages if m["role"] == "user"] == [row["prompt"], *feedback]
    for k in (1, 2):  # the engine's prompt k: prompt k-1 + its sampled ids + the feedback's chat tokens
        prev = ep.turns[k - 1]
        context = ChatTokens(tok).after_turn(prev["token_ids"], [{"role": "user", "content": feedback[k - 1]}])
        assert seen[k]["ids"] == prev["prompt_ids"] + prev["token_ids"] + context
        assert feedback[k - 1] in tok.decode(context)
    last = ep.turns[-1]
    assert ep.ids == last["prompt_ids"] + last["token_ids"]  # what the trainer gets is what the engine saw
    sampled = [t for turn in ep.turns for t in turn["token_ids"]]
    assert [t for t, m in zip(ep.completion_ids, ep.mask) if m] == sampled
    # @vf.reward last_exact (0.5) + run()'s record_reward steps_right (0.5): 2 of 3 turns right
    assert ep.stats.rewards == {"last_exact": 1.0, "steps_right": pytest.approx(2 / 3)}
    assert rollout.reward(ep, row) == pytest.approx(0.5 + 0.5 * 2 / 3)


def test_max_turns_ends_the_exchange_with_a_terminated_segment(tiny_model_dir, tmp_path):
    from tests.test_episodes import scripted

    cfg, rows, tok = _steps(tiny_model_dir, tmp_path, max_turns=2)
    answers = rows[0]["vf_task"]["answers"]
    generate, seen = scripted(tok, answers)
    rollout = EpisodeRollout(cfg, tok)
    ep = asyncio.run(rollout.play(rows[0], generate))
    # run()'s third turn() came back terminated: it stopped, recorded its reward, the trace was scored
    assert len(seen) == 2 and ep.stats.turns == 2 and ep.stats.truncated
    assert ep.stats.rewards == {"last_exact": 0.0, "steps_right": pytest.approx(2 / 3)}
    assert ep.step_rewards == [None, pytest.approx(1 / 3)]


def _live_tasks() -> set:
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}


def test_a_raising_run_fails_its_episode_only(tiny_model_dir, tmp_path):
    from app.envs import EnvError
    from tests.test_episodes import scripted

    cfg, rows, tok = _steps(tiny_model_dir, tmp_path, args={"size": 4, "turns": 3, "fail_after": 2})
    broken = EpisodeRollout(cfg, tok)
    fine = EpisodeRollout(vf_config(tiny_model_dir, tmp_path, **STEPS), tok)
    answers = rows[0]["vf_task"]["answers"]

    async def both():
        results = await asyncio.gather(broken.play(rows[0], scripted(tok, answers)[0]),
                                       fine.play(rows[0], scripted(tok, answers)[0]), return_exceptions=True)
        return results, _live_tasks()

    (failed, ok), left = asyncio.run(both())
    assert isinstance(failed, EnvError) and "StepsEnv.run() raised RuntimeError" in str(failed)
    assert "bug on purpose after turn 2" in str(failed)
    assert ok.stats.turns == 3 and ok.stats.rewards["steps_right"] == 1.0
    assert not left  # no run() left behind


def test_an_abandoned_episode_leaves_no_run_behind(tiny_model_dir, tmp_path):
    """A group abandoned mid-episode (its task cancelled while a turn generates): the environment's run(), waiting
    in turn() for the reply, is cancelled with it; an episode truncated by tokens likewise."""
    from tests.test_episodes import scripted

    cfg, rows, tok = _steps(tiny_model_dir, tmp_path)
    rollout = EpisodeRollout(cfg, tok)
    answers = rows[0]["vf_task"]["answers"]
    generate, seen = scripted(tok, answers)

    async def abandon():
        started = asyncio.Event()

        async def stalls_on_turn_2(ids, max_tokens, replica):
            if seen:
                started.set()
                await asyncio.sleep(3600)
            return await generate(ids, max_tokens, replica)

        play = asyncio.create_task(rollout.play(rows[0], stalls_on_turn_2))
        await asyncio.wait_for(started.wait(), 30)
        assert len(_live_tasks()) == 2  # the episode and the environment's run()
        play.cancel()
        with pytest.raises(asyncio.CancelledError):
            await play
        return _live_tasks()

    assert not asyncio.run(abandon())
    short = EpisodeRollout(cfg.replace(env={"max_episode_tokens": 40}), tok)

    async def truncated():
        ep = await short.play(rows[0], scripted(tok, answers)[0])
        return ep, _live_tasks()

    ep, left = asyncio.run(truncated())
    assert ep.stats.truncated and ep.stats.turns < 3 and not left


def test_retokenization_detector():
    assert extends([1, 2], [3, 4], [1, 2, 3, 4, 9, 10])
    assert not extends([1, 2], [3, 4], [1, 2, 34, 9])  # "3 4" merged into one token when re-tokenized
    assert not extends([1, 2], [3, 4], [1, 2, 3])
    turns = [{"prompt_ids": [1], "token_ids": [2, 3]}, {"prompt_ids": [1, 2, 3, 7], "token_ids": [8]},
             {"prompt_ids": [1, 2, 3, 7, 88, 9], "token_ids": [5]},
             {"prompt_ids": [1, 2, 3, 7, 88, 9, 5], "token_ids": []}]
    assert retokenized_turns(turns) == [3]
    assert retokenized_turns(turns[:1]) == []


def test_a_retokenized_episode_is_counted_and_not_trained_on(tiny_model_dir):
    from transformers import AutoTokenizer

    from app.chat_tokens import ChatTokens
    from app.episodes import run_episode
    from tests.test_episodes import Feedback, scripted

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    generate, _ = scripted(tok, ["a", "b", "c"])

    async def drifting(ids, max_tokens, replica):  # a client that re-rendered turn 2's prompt differently
        out = await generate(ids, max_tokens, replica)
        return dict(out, prompt_token_ids=list(ids[:-1]) + [ids[-1] + 1]) if len(ids) > 20 else out

    ep = asyncio.run(run_episode(Feedback({"answer": "Q"}), ChatTokens(tok), drifting, max_turns=3,
                                 max_tokens_per_turn=4, max_episode_tokens=512, timeout_s=5.0))
    assert ep.stats.turns == 3 and ep.stats.retokenized_turns >= 1 and sum(ep.mask) == 0


@pytest.mark.parametrize("env, match", [
    ({"verifiers": "vf_no_such_env"}, "no environment 'vf_no_such_env' is installed"),
    ({"verifiers": "vf_empty_env"}, "yielded no tasks"),
    ({"verifiers": "vf_no_rubric_env"}, "has no @vf.reward"),
    ({"verifiers": "vf_letters_env", "args": {"sizes": 3}}, "failed to load.*sizes"),
    ({"verifiers": "vf_two_seat_env"}, r"TwoSeatEnv declares the seats \['player', 'user'\]"),
])
def test_bad_environments_fail_at_validation(tiny_model_dir, tmp_path, capsys, env, match):
    import re

    from app.__main__ import cmd_validate

    sets = [f"model.path={tiny_model_dir}", "model.build_tiny=false", f"run.out_dir={tmp_path}",
            f"env.verifiers={env['verifiers']}"] + [f"env.args={json.dumps(env.get('args', {}))}"]
    assert cmd_validate(["--config", "recipes/verifiers-cpu.yaml", *[a for s in sets for a in ("--set", s)]]) == 2
    assert re.search(match, capsys.readouterr().err, re.S)


def test_config_rules_and_a_missing_package(monkeypatch):
    from app.verifiers_env import VerifiersError, import_verifiers

    with pytest.raises(C.ConfigError, match="not both"):
        C.Config().replace(env={"verifiers": "x", "cls": "a:B"}, reward={"fn": None}, eval={"path": None})
    with pytest.raises(C.ConfigError, match="reward.fn: a verifiers environment"):
        C.Config().replace(env={"verifiers": "x"}, eval={"path": None})
    with pytest.raises(C.ConfigError, match="env.args"):
        C.Config().replace(env={"args": {"size": 3}})
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)  # import verifiers.v1 raises ImportError
    with pytest.raises(VerifiersError, match=r'pip install -e "\.\[envs\]"'):
        import_verifiers()
    import importlib.util

    from common.config.rules import machine_problems
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "verifiers" else real(name, *a))
    cfg = C.Config().replace(env={"verifiers": "x"}, reward={"fn": None}, eval={"path": None})
    assert any("[envs]" in p for p in machine_problems(cfg))


@pytest.mark.slow
def test_a_short_run_trains_on_the_environment_and_evaluates_held_out_tasks_every_step(serve_env, tmp_path):
    """Real Ray, Serve, vLLM, DeepSpeed, one run (each costs ~60 s of starts on 2 cores):
    - training: the environment's tasks are sampled as token-exact episodes under the pinned version, scored by its
      rubric; every step's row carries each reward function's mean score;
    - evaluation: the base policy and every published version are scored on held-out tasks of the environment by
      its rubric (greedy episodes under the evaluated version), with each function's score."""
    from app import driver
    from app.evaluate import eval_rows
    from app.verifiers_env import verifiers_rows

    cfg = C.load("recipes/verifiers-cpu.yaml", [
        f"model.path={serve_env.model_dir}", "model.build_tiny=false", f"run.out_dir={tmp_path}", "run.name=vfev",
        'env.args={"size": 32}', "eval.path=verifiers", 'eval.args={"seed": 1}', "eval.samples=4", "eval.every=1",
        "train.total_steps=2", "train.num_workers=1", "train.cpus_per_worker=0.5", "rollout.replicas=1",
        "rollout.cpus_per_replica=0.5", "grpo.prompts_per_step=2", "grpo.group_size=4", "checkpoint.every=0",
        f"rollout.http_port={serve_env.http_port}", "run.stall_timeout_s=300"])
    summary = driver.run(cfg, progress=False)
    assert summary["steps"] == 2
    rows = [json.loads(line) for line in (tmp_path / "vfev" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step" in r and "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        # exact_match is the only weighted function: the GRPO reward is its score
        assert r["reward/exact_match"] == pytest.approx(r["reward_mean"])
        assert 0.0 <= r["reward/starts_with_answer"] <= 1.0 and r["reward/starts_with_answer"] >= r["reward_mean"]
        assert r["retokenized_turns"] == 0 and r["episode_turns_mean"] == 1.0
    assert steps[0]["log_ratio_abs_max"] <= LOGPROB_TOL  # step 1: the trained ids and logprobs are the engine's
    history = summary["eval_history"]
    assert history and history[-1]["eval/step"] == 2 and history[-1]["eval/version"] >= 1  # a trained version
    assert summary["eval/samples"] == 4
    for ev in history:
        for key in ("eval/accuracy", "eval/reward_mean", "eval/reward/exact_match", "eval/reward/starts_with_answer"):
            assert math.isfinite(ev[key]) and 0.0 <= ev[key] <= 1.0, (key, ev)
        # exact_match is the only weighted function: the greedy reward is its score, correct when it is 1
        assert ev["eval/reward_mean"] == pytest.approx(ev["eval/reward/exact_match"]) == ev["eval/accuracy"]
        assert ev["eval/env_errors"] == 0
    assert any("eval/accuracy" in r for r in rows)
    # the held-out tasks of the run's own config (as the driver read them): none is a training prompt
    run_cfg = C.from_dict(yaml.safe_load((tmp_path / "vfev" / "config.yaml").read_text()))
    held = eval_rows(run_cfg)
    assert len(held) == 4 and not ({r["prompt"] for r in verifiers_rows(run_cfg.env, run_cfg.data.builtin_size)}
                                  & {r["prompt"] for r in held})
