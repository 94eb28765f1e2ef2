"""Held-out evaluation of a verifiers run (`eval.path: verifiers`, app/verifiers_eval.py): the config rules, the
held-out tasks (the environment's taskset under eval.args over env.args, none a training task; an infinite
taskset's tasks after the training ones; too few left or a refused eval config is one error naming the key), the
per-function eval scores. The short real run that evaluates every step is in tests/test_verifiers_env.py (it shares
that module's Ray and Serve)."""
from __future__ import annotations

import pytest

from app.data_errors import DataError
from app.evaluate import eval_rows, reward_parts
from common import config as C
from tests.test_verifiers_env import support_importable, vf_config  # noqa: F401  (tests/support on the path)

LETTERS = {"verifiers": "vf_letters_env", "args": {"size": 16}}


def _cfg(tiny_model_dir, tmp_path, env=None, **eval_keys):
    return vf_config(tiny_model_dir, tmp_path, **(env or LETTERS)).replace(
        eval={"path": "verifiers", "samples": 4, **eval_keys})


def _training(cfg) -> list[dict]:
    from app.verifiers_env import verifiers_rows

    return verifiers_rows(cfg.env, cfg.data.builtin_size)


def test_config_rules():
    base = {"env": {"verifiers": "x"}, "reward": {"fn": None}}
    cfg = C.Config().replace(**base, eval={"path": "verifiers", "args": {"seed": 1}})
    assert cfg.eval.path == "verifiers" and cfg.adapter_slots == cfg.sync.live_versions + 2  # one for the eval
    with pytest.raises(C.ConfigError, match="eval.path: a verifiers run .* set eval.path: verifiers"):
        C.Config().replace(**base, eval={"path": "builtin:letters-heldout"})
    with pytest.raises(C.ConfigError, match="eval.path: verifiers evaluates on .* set env.verifiers"):
        C.Config().replace(eval={"path": "verifiers"})
    with pytest.raises(C.ConfigError, match="eval.args: .* neither reasoning-gym:TASK nor verifiers"):
        C.Config().replace(eval={"path": "builtin:letters-heldout", "args": {"seed": 1}})


def test_held_out_tasks_are_never_training_tasks(tiny_model_dir, tmp_path):
    cfg = _cfg(tiny_model_dir, tmp_path, args={"seed": 1}, samples=8)
    held = eval_rows(cfg)
    training = {r["prompt"] for r in _training(cfg)}
    assert len(held) == 8 and len({r["prompt"] for r in held}) == 8
    assert not training & {r["prompt"] for r in held}
    assert all(r["id"].startswith("heldout-letters-") and r["vf_task"]["answer"] == r["answer"] for r in held)
    assert eval_rows(cfg) == held  # deterministic
    # a training prompt drawn again under the eval seed is dropped: the eval seed with the training one's tasks
    wider = eval_rows(_cfg(tiny_model_dir, tmp_path, args={"seed": 0, "size": 64}, samples=40))
    assert not training & {r["prompt"] for r in wider}
    assert all(int(r["vf_task"]["idx"]) >= 16 for r in wider)  # the first 16 of seed 0 are the training tasks


def test_a_finite_taskset_without_eval_args_has_nothing_left(tiny_model_dir, tmp_path):
    with pytest.raises(DataError, match=r"has only 0 tasks that are not training tasks .* \{'size': 16\} .*"
                                        r"name the held-out tasks in eval.args"):
        eval_rows(_cfg(tiny_model_dir, tmp_path))
    with pytest.raises(DataError, match=r"(?s)eval.args: \{'sizes': 3\} over env.args: .*failed to load.*sizes"):
        eval_rows(_cfg(tiny_model_dir, tmp_path, args={"sizes": 3}))


def test_an_infinite_taskset_holds_out_the_tasks_after_the_training_ones(tiny_model_dir, tmp_path):
    cfg = _cfg(tiny_model_dir, tmp_path, env={"verifiers": "vf_letters_stream_env", "args": {}}).replace(
        data={"builtin_size": 32})
    training = _training(cfg)
    held = eval_rows(cfg)
    assert len(training) == 32 and len(held) == 4
    assert all(int(r["vf_task"]["idx"]) >= 32 for r in held)
    assert not {r["prompt"] for r in training} & {r["prompt"] for r in held}


def test_a_multi_turn_environments_tasks_differ_by_their_data(tiny_model_dir, tmp_path):
    """vf_steps_env opens every episode with 'Say the letter X.' (26 prompts) and asks for more letters in later
    turns: a task is held out when its data differs, even if its first prompt is a training one's."""
    from app.verifiers_eval import task_key

    env = {"verifiers": "vf_steps_env", "args": {"size": 32, "turns": 3}}
    cfg = _cfg(tiny_model_dir, tmp_path, env=env, args={"seed": 5}, samples=16)
    training = _training(cfg)
    held = eval_rows(cfg)
    assert len(held) == 16
    keys = {task_key(r, single_turn=False) for r in training}
    assert not keys & {task_key(r, single_turn=False) for r in held}
    assert {r["prompt"] for r in training} & {r["prompt"] for r in held}  # same openings, other games


def test_eval_episodes_load_the_environment_of_the_eval_config(tiny_model_dir, tmp_path):
    from app.verifiers_eval import eval_config

    cfg = _cfg(tiny_model_dir, tmp_path, args={"seed": 1})
    assert eval_config(cfg).env.args == {"size": 16, "seed": 1} and cfg.env.args == {"size": 16}
    assert eval_config(cfg.replace(eval={"args": {}})) == cfg.replace(eval={"args": {}})
    other = C.Config().replace(env={"cls": "app.builtin_envs:LetterHunt"}, reward={"fn": None},
                               eval={"path": "reasoning-gym:basic_arithmetic", "args": {"seed": 3}})
    assert eval_config(other) is other  # eval.args there is the reasoning-gym task's, not an environment's


def test_reward_parts_average_the_scored_episodes():
    parts = [{"exact_match": 1.0, "starts": 1.0}, {"exact_match": 0.0, "starts": 1.0}, {}]  # the last one failed
    assert reward_parts(parts) == {"eval/reward/exact_match": 0.5, "eval/reward/starts": 1.0}
    assert reward_parts([{}, {}]) == {}


def test_validate_names_a_missing_held_out_split(tiny_model_dir, tmp_path, capsys):
    from app.__main__ import cmd_validate

    sets = [f"model.path={tiny_model_dir}", "model.build_tiny=false", f"run.out_dir={tmp_path}",
            'env.args={"size": 16}', "eval.path=verifiers", "eval.samples=4"]
    assert cmd_validate(["--config", "recipes/verifiers-cpu.yaml", *[a for s in sets for a in ("--set", s)]]) == 2
    assert "name the held-out tasks in eval.args" in capsys.readouterr().err
    assert cmd_validate(["--config", "recipes/verifiers-cpu.yaml", *[a for s in sets for a in ("--set", s)],
                         "--set", 'eval.args={"seed": 1}']) == 0
