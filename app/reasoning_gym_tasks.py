"""reasoning-gym tasks as prompts and rewards: `data.path: reasoning-gym:TASK` (task config in `data.args`),
several tasks mixed by weight (`data.mix`), held-out eval items of the same task (`eval.path`, another seed,
never a training question), and the task's own checker as the reward (`score_answer_tag`, `score_boxed`,
`score_whole`: which part of the completion it is given, `reward.extract`).

Rows are `{id, prompt, answer, task, task_args, entry}`: `prompt` is the item's question, `answer` its reference
answer as text, `entry` the item itself (answer and metadata, what reasoning-gym's `score_answer` reads) and
`task_args` the task's config as JSON (the reward rebuilds the dataset from it, once per process).

reasoning-gym is imported only here and only when a config names it: the main job runs without the `envs` extra.
"""
from __future__ import annotations

import difflib
import functools
import json
import random

from app.data_errors import DataError
from common.config.reasoning_gym import REASONING_GYM

EXTRA_HINT = 'pip install -e ".[envs]"'
EVAL_SEED_OFFSET = 1_000_003  # eval items come from another seed than the training ones (eval.args.seed overrides)
_EVAL_DRAWS = 4  # eval generates this many times the items it needs, to have enough left after the dedupe


def is_reasoning_gym(path: str | None) -> bool:
    return bool(path) and path.startswith(REASONING_GYM)


def _gym():
    try:
        import reasoning_gym
    except ImportError:
        raise DataError(f"reasoning-gym tasks need the reasoning-gym package, which is not installed: "
                        f"{EXTRA_HINT}") from None
    return reasoning_gym


def task_names() -> list[str]:
    _gym()
    from reasoning_gym.factory import DATASETS

    return sorted(name for name in DATASETS if name != "composite")


def task_of(path: str, key: str) -> str:
    """`reasoning-gym:TASK` -> TASK, a registered task (else a DataError naming the closest ones)."""
    task = path[len(REASONING_GYM):].strip()
    names = task_names()
    if task not in names:
        close = difflib.get_close_matches(task, names, n=5, cutoff=0.5)
        hint = f"closest: {', '.join(close)}" if close else f"{len(names)} tasks, e.g. {', '.join(names[:8])}"
        raise DataError(f"{key}: {task!r} is not a reasoning-gym task ({hint})")
    return task


def make_dataset(task: str, args: dict, key: str):
    """The task's dataset, its config errors (unknown keys, bad values) named with the task and the key."""
    gym = _gym()
    try:
        return gym.create_dataset(task, **args)
    except (TypeError, ValueError, AssertionError, KeyError) as e:
        raise DataError(f"{key}: reasoning-gym task {task!r} refused its config {args}: "
                        f"{type(e).__name__}: {e}") from None


def _rows(task: str, args: dict, key: str, id_prefix: str) -> list[dict]:
    dataset = make_dataset(task, args, key)
    task_args = json.dumps(args, sort_keys=True)
    return [{"id": f"{id_prefix}-{i}", "prompt": entry["question"], "answer": str(entry["answer"]), "task": task,
             "task_args": task_args, "entry": entry} for i, entry in enumerate(dataset)]


def _with_size_seed(args: dict, size: int, seed: int) -> dict:
    return {"size": size, "seed": seed, **args}


def training_rows(cfg) -> list[dict]:
    """`cfg` (DataConfig): rows of `data.path: reasoning-gym:TASK` or of the `data.mix`."""
    if cfg.mix:
        return mix_rows(cfg)
    task = task_of(cfg.path, "data.path")
    return _rows(task, _with_size_seed(cfg.args, cfg.builtin_size, cfg.shuffle_seed), "data.args", task)


def mix_counts(weights: list[float], total: int) -> list[int]:
    """`total` items split by weight, largest remainders first (the counts sum to `total`)."""
    shares = [w / sum(weights) * total for w in weights]
    counts = [int(s) for s in shares]
    by_remainder = sorted(range(len(weights)), key=lambda i: (counts[i] - shares[i], i))
    for i in by_remainder[:total - sum(counts)]:
        counts[i] += 1
    return counts


def mix_rows(cfg) -> list[dict]:
    """`data.mix`: each task's share of `size` (data.args.size, else data.builtin_size) by weight, from seed
    data.args.seed (else data.shuffle_seed) + its position + 1 unless its args say; rows interleaved in a
    seeded order (the run shuffles them again per epoch)."""
    size, seed = cfg.args.get("size", cfg.builtin_size), cfg.args.get("seed", cfg.shuffle_seed)
    counts = mix_counts([float(m.get("weight", 1.0)) for m in cfg.mix], size)
    rows: list[dict] = []
    for i, (m, n) in enumerate(zip(cfg.mix, counts)):
        task = task_of(m["path"], f"data.mix[{i}].path")
        if n:
            rows += _rows(task, _with_size_seed(m.get("args", {}), n, seed + i + 1), f"data.mix[{i}].args", task)
    random.Random(seed).shuffle(rows)
    return rows


def _trained_args(cfg, task: str) -> dict | None:
    """The task config the run trains `task` with (data.args or its data.mix entry's), None if it does not."""
    data = cfg.data
    if data.mix:
        return next((dict(m.get("args", {})) for m in data.mix if m["path"].strip() == REASONING_GYM + task), None)
    if is_reasoning_gym(data.path) and data.path[len(REASONING_GYM):].strip() == task:
        return {k: v for k, v in data.args.items() if k not in ("size", "seed")}
    return None


def eval_rows(cfg, samples: int) -> list[dict]:
    """`samples` held-out items of `eval.path: reasoning-gym:TASK`: the task's training config (if the run trains
    it) updated by `eval.args`, from seed data seed + EVAL_SEED_OFFSET unless eval.args.seed says, and none whose
    question is a training question (DataError when too few are left)."""
    task = task_of(cfg.eval.path, "eval.path")
    seed = cfg.data.args.get("seed", cfg.data.shuffle_seed) + EVAL_SEED_OFFSET
    args = {**(_trained_args(cfg, task) or {}), "seed": seed, "size": samples * _EVAL_DRAWS, **cfg.eval.args}
    training = set()
    if cfg.data.mix or is_reasoning_gym(cfg.data.path):
        training = {r["prompt"] for r in training_rows(cfg.data)}
    rows, seen = [], set()
    for r in _rows(task, args, "eval.args", f"{task}-heldout"):
        if r["prompt"] not in training and r["prompt"] not in seen:
            seen.add(r["prompt"])
            rows.append(r)
    if len(rows) < samples:
        raise DataError(f"eval.path: {cfg.eval.path} has only {len(rows)} items (of {args['size']} drawn from seed "
                        f"{args['seed']}) that are not training questions, {samples} asked for (eval.samples); "
                        "widen the task's config in eval.args or lower eval.samples")
    return rows[:samples]


# ---------------------------------------------------------------------------------------------- rewards


@functools.lru_cache(maxsize=64)
def _dataset_for(task: str, task_args: str):
    return make_dataset(task, json.loads(task_args), "reward")


def extract_answer_tag(completion: str) -> str | None:
    from reasoning_gym.utils import extract_answer

    return extract_answer(completion)


def _score(got: str | None, row: dict) -> float:
    """The task's own checker on `got` (partial credit as reasoning-gym gives it); 0 for no answer."""
    if got is None:
        return 0.0
    if "entry" not in row or "task" not in row:
        raise ValueError("the reasoning-gym reward needs rows of data.path: reasoning-gym:TASK (or data.mix); "
                         f"row {row.get('id')!r} has no reasoning-gym entry")
    dataset = _dataset_for(row["task"], row["task_args"])
    try:
        return float(dataset.score_answer(got, row["entry"]))
    except Exception:  # a checker that chokes on malformed output: that output earns nothing
        return 0.0


def score_answer_tag(completion: str, answer: str, prompt: str = "", *, row: dict) -> float:
    """The task's score of the last `<answer>...</answer>` (reasoning-gym's extract_answer)."""
    return _score(extract_answer_tag(completion), row)


def score_boxed(completion: str, answer: str, prompt: str = "", *, row: dict) -> float:
    """The task's score of the last `\\boxed{...}`."""
    from app.rewards import last_boxed

    return _score(last_boxed(completion), row)


def score_first_boxed(completion: str, answer: str, prompt: str = "", *, row: dict) -> float:
    """The task's score of the first `\\boxed{...}`: a pretrained model seldom ends its turn after answering
    and writes on, other boxed numbers included."""
    from app.rewards import first_boxed

    return _score(first_boxed(completion), row)


def score_whole(completion: str, answer: str, prompt: str = "", *, row: dict) -> float:
    """The task's score of the whole completion, stripped."""
    return _score(completion.strip(), row)
