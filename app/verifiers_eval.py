"""Held-out evaluation tasks of the run's verifiers environment (`eval.path: verifiers`; docs/VERIFIERS.md).

verifiers 0.4 has no eval split of its own (read from its source): a `Taskset` is config in, tasks out, and its
eval entrypoint evaluates the tasks its taskset config names (`--env.taskset.*`: a dataset split, a seed, ...),
narrowed by `select` (positions, ids, shuffle, limit). So the held-out tasks are the environment's taskset loaded
with `eval.args` over `env.args` (the taskset's own config fields, as reasoning-gym's eval.args is the task's config
over the training one), read in order, dropping every task that is a training task and repeats (`task_key`: the
same prompt, or for an Env with its own run() the same task data).
With no eval.args an infinite taskset holds out the tasks after the training ones (it trains on the first
`data.builtin_size`); a finite one trains on all its tasks, so nothing is left: the error says to name its held-out
tasks in eval.args.

Evaluation then plays these tasks as episodes of the environment loaded with the same config (`eval_config`), so
the environment's own rubric scores them (the weighted sum, as in training).
"""
from __future__ import annotations

import json

from app.data_errors import DataError

_EVAL_DRAWS = 4  # an infinite taskset is read this many times the tasks asked for past the training ones
_IDENTITY = ("idx", "id", "name")  # a task's position and names, not what the model is asked


def eval_config(cfg):
    """`cfg` (Config) whose environment is the one the held-out tasks come from: env.args updated by eval.args
    (with eval.path verifiers; any other run's environment is its own)."""
    from common.config import VERIFIERS_EVAL

    if cfg.eval.path != VERIFIERS_EVAL or not cfg.eval.args:
        return cfg
    return cfg.replace(env={"args": {**cfg.env.args, **cfg.eval.args}})


def task_key(row: dict, single_turn: bool) -> str:
    """What makes two tasks the same question: what their episode shows the model. A single-turn environment shows
    the prompt; an Env with its own run() (later turns drawn from the task's other fields, e.g. a game's secret)
    or a prompt-less task is its data without position and names."""
    if single_turn and row["prompt"]:
        return row["prompt"]
    return json.dumps({k: v for k, v in row["vf_task"].items() if k not in _IDENTITY}, sort_keys=True, default=str)


def eval_rows(cfg, samples: int) -> list[dict]:
    """`samples` held-out tasks of `cfg`'s verifiers environment as data rows (ids `heldout-ID`), none a training
    task (`task_key`). DataError when the eval config does not load or too few tasks are left."""
    from app.verifiers_env import VerifiersError, load, single_agent, task_row, verifiers_rows

    limit = cfg.data.builtin_size
    try:
        single_turn = single_agent(load(cfg.env))
        training = {task_key(r, single_turn) for r in verifiers_rows(cfg.env, limit)}
    except VerifiersError as e:
        raise DataError(str(e)) from None
    env_cfg = eval_config(cfg).env
    try:
        taskset = load(env_cfg).taskset
    except VerifiersError as e:
        raise DataError(f"eval.args: {dict(cfg.eval.args)} over env.args: {e}") from None
    read, infinite = limit + samples * _EVAL_DRAWS, not taskset.bounded
    if infinite:
        taskset = taskset.take(read)
    rows, seen = [], set()
    for task in taskset:
        row = task_row(task)
        key = task_key(row, single_turn)
        if key in training or key in seen:
            continue
        seen.add(key)
        rows.append(dict(row, id=f"heldout-{row['id']}"))
        if len(rows) == samples:
            return rows
    among = f"the first {read} tasks" if infinite else "the tasks"
    raise DataError(
        f"eval.path: verifiers: {cfg.env.verifiers!r} has only {len(rows)} tasks that are not training tasks among "
        f"{among} of its taskset config {dict(env_cfg.args)} (env.args + eval.args), {samples} asked for "
        "(eval.samples); verifiers has no eval split of its own: name the held-out tasks in eval.args, the taskset's "
        "config over env.args (another seed, a split field of its config, ...), or lower eval.samples")
