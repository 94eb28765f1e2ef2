"""reasoning-gym tasks as data and reward (app/reasoning_gym_tasks.py): rows from `data.path: reasoning-gym:TASK`
and `data.mix`, the task's own checker as the default reward, held-out eval items, and the errors of a bad task,
bad task config or a missing package. The last test runs a few steps of the recipe on CPU (slow)."""
from __future__ import annotations

import json
import sys
from collections import Counter

import pytest

pytest.importorskip("reasoning_gym")

from app import reasoning_gym_tasks as rgt  # noqa: E402
from app.data import DataError, load_prompts  # noqa: E402
from app.evaluate import eval_rows  # noqa: E402
from app.rewards import load_scorer  # noqa: E402
from common.config import ConfigError, from_dict, load  # noqa: E402
from tests._serve_helpers import serve_env  # noqa: E402, F401  (the slow test's fixture)

ARITH = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}


def _cfg(**sections):
    return from_dict(sections)


def _arith(size=64, seed=0, **more):
    return _cfg(data={"path": "reasoning-gym:basic_arithmetic", "builtin_size": size, "shuffle_seed": seed,
                      "args": ARITH}, **more)


def test_rows_are_the_tasks_items_with_their_entry():
    import reasoning_gym

    rows = load_prompts(_arith(size=16, seed=3).data)
    items = list(reasoning_gym.create_dataset("basic_arithmetic", size=16, seed=3, **ARITH))
    assert [r["prompt"] for r in rows] == [e["question"] for e in items]
    assert [r["answer"] for r in rows] == [str(e["answer"]) for e in items]
    assert rows[0]["entry"] == items[0] and rows[0]["task"] == "basic_arithmetic"
    assert len({r["id"] for r in rows}) == 16
    # data.args.size / seed win over builtin_size / shuffle_seed; another seed, other items
    other = load_prompts(_cfg(data={"path": "reasoning-gym:basic_arithmetic",
                                    "args": {**ARITH, "size": 5, "seed": 4}}).data)
    assert len(other) == 5 and [r["prompt"] for r in other] != [r["prompt"] for r in rows[:5]]


def test_default_reward_is_the_tasks_checker_on_the_extracted_answer():
    assert _arith().reward.fn == "app.reasoning_gym_tasks:score_answer_tag"
    assert _arith(reward={"extract": "boxed"}).reward.fn == "app.reasoning_gym_tasks:score_boxed"
    assert _arith(reward={"extract": "none"}).reward.fn == "app.reasoning_gym_tasks:score_whole"
    assert _arith(reward={"extract": "first_boxed"}).reward.fn == "app.reasoning_gym_tasks:score_first_boxed"
    assert _arith(reward={"fn": "app.rewards:boxed_math_reward"}).reward.fn == "app.rewards:boxed_math_reward"
    assert from_dict(_arith(reward={"extract": "boxed"}).to_dict()).reward.fn.endswith("score_boxed")
    assert _cfg().reward.fn == "app.rewards:letter_reward"  # other data: unchanged
    with pytest.raises(ConfigError, match="reward.extract: boxed picks the reasoning-gym reward"):
        _arith(reward={"extract": "boxed", "fn": "app.rewards:boxed_math_reward"})


def test_rewards_score_with_the_tasks_partial_credit():
    import reasoning_gym

    row = load_prompts(_arith(size=4).data)[0]
    own = reasoning_gym.create_dataset("basic_arithmetic", size=1, **ARITH).score_answer
    tag, boxed, whole = (load_scorer(f"app.reasoning_gym_tasks:{f}")
                         for f in ("score_answer_tag", "score_boxed", "score_whole"))
    right, wrong = row["answer"], row["answer"] + "0"
    assert tag(f"thinking... <answer> {right} </answer>", row) == 1.0
    # the last tag counts, scored as the task scores it (basic_arithmetic gives partial credit)
    last = tag(f"<answer>{right}</answer> no, <answer>{wrong}</answer>", row)
    assert last < 1.0 and last == pytest.approx(own(wrong, row["entry"]))
    assert tag(right, row) == 0.0  # no tag, no answer
    assert boxed(f"so \\boxed{{{right}}}", row) == 1.0 and boxed(f"<answer>{right}</answer>", row) == 0.0
    first = load_scorer("app.reasoning_gym_tasks:score_first_boxed")
    assert first(f"\\boxed{{{right}}}. Next: \\boxed{{{wrong}}}", row) == 1.0
    assert boxed(f"\\boxed{{{right}}}. Next: \\boxed{{{wrong}}}", row) < 1.0
    assert whole(f"  {right}\n", row) == 1.0 and whole("seven", row) == pytest.approx(own("seven", row["entry"]))
    spell = load_prompts(_cfg(data={"path": "reasoning-gym:spell_backward", "builtin_size": 4}).data)
    r = next(r for r in spell if len(r["answer"]) > 3)
    expected = reasoning_gym.create_dataset("spell_backward", size=1).score_answer(r["answer"][:-1], r["entry"])
    got = tag(f"<answer>{r['answer'][:-1]}</answer>", r)
    assert 0.0 < got < 1.0 and got == pytest.approx(expected)


def test_reward_on_a_row_without_an_entry_names_the_problem():
    with pytest.raises(ValueError, match="reasoning-gym entry"):
        rgt.score_answer_tag("<answer>K</answer>", "K", "p", row={"id": "letters-0", "prompt": "p", "answer": "K"})


def test_held_out_items_are_never_training_questions():
    cfg = _arith(size=200, eval={"path": "reasoning-gym:basic_arithmetic", "samples": 40})
    train = {r["prompt"] for r in load_prompts(cfg.data)}
    held = eval_rows(cfg)
    assert len(held) == 40 and not train & {r["prompt"] for r in held}
    assert len({r["prompt"] for r in held}) == 40
    assert json.loads(held[0]["task_args"])["seed"] == 0 + rgt.EVAL_SEED_OFFSET
    assert json.loads(held[0]["task_args"])["max_digits"] == 2  # the training task's config
    assert eval_rows(cfg) == held  # deterministic
    # eval.args overrides: a task config of its own, a seed of its own
    wide = eval_rows(cfg.replace(eval={"args": {"max_digits": 3, "seed": 9}}))
    assert json.loads(wide[0]["task_args"])["seed"] == 9 and not train & {r["prompt"] for r in wide}


def test_held_out_from_the_training_seed_has_nothing_left():
    cfg = _arith(size=64, eval={"path": "reasoning-gym:basic_arithmetic", "samples": 8, "args": {"seed": 0}})
    with pytest.raises(DataError, match="not training questions"):
        eval_rows(cfg)


def test_mix_splits_by_weight_and_rows_remember_their_task():
    assert rgt.mix_counts([3, 1], 10) == [8, 2] and rgt.mix_counts([1, 1, 1], 10) == [4, 3, 3]
    assert sum(rgt.mix_counts([0.2, 0.5, 0.3], 17)) == 17
    cfg = _cfg(data={"mix": [{"path": "reasoning-gym:basic_arithmetic", "weight": 3, "args": ARITH},
                             {"path": "reasoning-gym:leg_counting", "weight": 1,
                              "args": {"min_animals": 1, "max_animals": 2}}],
                     "args": {"size": 40, "seed": 5}})
    assert cfg.reward.fn == "app.reasoning_gym_tasks:score_answer_tag"
    rows = load_prompts(cfg.data)
    assert Counter(r["task"] for r in rows) == {"basic_arithmetic": 30, "leg_counting": 10}
    assert len({r["id"] for r in rows}) == 40
    assert [r["task"] for r in rows[:10]] != sorted(r["task"] for r in rows[:10])  # interleaved
    scorer = load_scorer(cfg.reward.fn)
    legs = next(r for r in rows if r["task"] == "leg_counting")
    assert scorer(f"<answer>{legs['answer']}</answer>", legs) == 1.0
    # a mixed run's held-out eval of one of its tasks: that task's mix config, none of its training items
    held = eval_rows(cfg.replace(eval={"path": "reasoning-gym:leg_counting", "samples": 5}))
    assert json.loads(held[0]["task_args"])["max_animals"] == 2
    assert not {r["prompt"] for r in rows} & {r["prompt"] for r in held}


def test_bad_task_names_and_args():
    with pytest.raises(DataError, match=r"'basic_arithmetc' is not a reasoning-gym task \(closest: basic_arithmetic"):
        load_prompts(_cfg(data={"path": "reasoning-gym:basic_arithmetc"}).data)
    with pytest.raises(DataError, match=r"data.args: reasoning-gym task 'basic_arithmetic' refused its config .*"
                                        r"unexpected keyword argument 'bogus'"):
        load_prompts(_cfg(data={"path": "reasoning-gym:basic_arithmetic", "args": {"bogus": 1}}).data)
    with pytest.raises(DataError, match=r"data.mix\[1\].args: reasoning-gym task 'leg_counting' refused its config"
                                        r".*AssertionError: max_animals must be >= min_animals"):
        load_prompts(_cfg(data={"mix": [{"path": "reasoning-gym:gcd"},
                                        {"path": "reasoning-gym:leg_counting", "args": {"max_animals": 1}}]}).data)
    with pytest.raises(DataError, match=r"eval.path: 'gdc' is not a reasoning-gym task \(closest: gcd"):
        eval_rows(_cfg(eval={"path": "reasoning-gym:gdc"}))


def test_config_rules_of_the_new_keys():
    with pytest.raises(ConfigError, match="data.args: a reasoning-gym task's config"):
        _cfg(data={"args": {"size": 3}})
    with pytest.raises(ConfigError, match="data.mix: replaces data.path"):
        _cfg(data={"path": "x.jsonl", "mix": [{"path": "reasoning-gym:gcd"}]})
    with pytest.raises(ConfigError, match="data.mix: replaces data.path"):
        _cfg(data={"path": "reasoning-gym:lcm", "mix": [{"path": "reasoning-gym:gcd"}]})
    with pytest.raises(ConfigError, match=r"data.mix\[0\]: expected"):
        _cfg(data={"mix": [{"path": "reasoning-gym:gcd", "weight": 0}]})
    with pytest.raises(ConfigError, match="data.mix: a task appears twice"):
        _cfg(data={"mix": [{"path": "reasoning-gym:gcd"}, {"path": "reasoning-gym:gcd", "weight": 2}]})
    with pytest.raises(ConfigError, match="data.args: with data.mix only size and seed"):
        _cfg(data={"mix": [{"path": "reasoning-gym:gcd"}], "args": {"max_value": 3}})
    with pytest.raises(ConfigError, match="eval.args: a reasoning-gym task's config"):
        _cfg(eval={"path": "builtin:letters-heldout", "args": {"seed": 1}})
    with pytest.raises(ConfigError, match="reward.extract"):
        _cfg(reward={"extract": "tags"})


def test_recipe_loads_and_train_help_lists_the_keys(capsys):
    cfg = load("recipes/reasoning-gym-cpu.yaml")
    assert cfg.reward.fn == "app.reasoning_gym_tasks:score_whole" and len(cfg.data.mix) == 2
    from app.__main__ import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert all(key in out for key in ("data.args", "data.mix", "reward.extract", "eval.args"))


def test_without_the_package_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # what `import reasoning_gym` meets when not installed
    with pytest.raises(DataError, match=r'reasoning-gym package, which is not installed: pip install -e "\.\[envs\]"'):
        load_prompts(_cfg(data={"path": "reasoning-gym:gcd"}).data)


def test_validate_refuses_an_unknown_task_before_any_engine(tiny_model_dir, capsys):
    from app.__main__ import main

    rc = main(["validate", "--config", "recipes/reasoning-gym-cpu.yaml", "--set", f"model.path={tiny_model_dir}",
               "--set", "model.build_tiny=false", "--set", "eval.path=reasoning-gym:basic_arithmetik"])
    err = capsys.readouterr().err
    assert rc == 2 and "eval.path: 'basic_arithmetik' is not a reasoning-gym task (closest: basic_arithmetic" in err


@pytest.mark.slow
def test_recipe_runs_a_few_steps_with_per_task_rewards(serve_env, tmp_path):
    from app import driver

    cfg = load("recipes/reasoning-gym-cpu.yaml", [
        f"model.path={serve_env.model_dir}", "model.build_tiny=false", f"run.out_dir={tmp_path}", "run.name=rg",
        "train.total_steps=3", "train.num_workers=1", "train.cpus_per_worker=0.5", "rollout.replicas=1",
        "rollout.cpus_per_replica=0.5", "grpo.prompts_per_step=8", "grpo.group_size=4", "checkpoint.every=0",
        "eval.samples=4", "eval.every=2", f"rollout.http_port={serve_env.http_port}", "run.stall_timeout_s=300"])
    summary = driver.run(cfg, progress=False)
    assert summary["steps"] == 3
    rows = [json.loads(line) for line in (tmp_path / "rg" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    tasks = {k for r in rows for k in r if k.startswith("reward/")}
    assert tasks <= {"reward/basic_arithmetic", "reward/leg_counting"} and "reward/basic_arithmetic" in tasks
    assert all(0.0 <= r[k] <= 1.0 for r in rows for k in tasks if k in r)
    assert summary["eval/samples"] == 4 and 0.0 <= summary["eval/accuracy"] <= 1.0
