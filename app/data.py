"""Prompts: parquet/JSONL files, directories of split files, `datasets` save_to_disk directories (read
with pyarrow, no `datasets` needed) or the builtin toy task; a column map, a seeded per-epoch shuffle and a
resumable cursor. Bad files, missing columns and bad rows fail here, before any actor starts.

`data.path` may be:
- a `.parquet`, `.jsonl`/`.json` (one object per line) or `.arrow` file;
- a directory written by `datasets` `save_to_disk`: a Dataset (`state.json` + `data-*.arrow`, read whole)
  or a DatasetDict (`dataset_dict.json`; `data.split` picks the split);
- a directory of split files: `SPLIT.parquet`, `SPLIT.jsonl`, `SPLIT-*.parquet` (shards, concatenated in
  name order) or `SPLIT/*.parquet`, directly in it or in its `data/` folder (the Hub's layout); `data.split`
  (default `train`) picks the split.

A bad row (a null/missing value, a non-string or empty prompt, an empty answer) is named by its 0-based row
number, column and problem; `data.on_bad_row: error` refuses the data, `skip` drops and counts such rows.
"""
from __future__ import annotations

import json
import logging
import random
import re
import string
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from app.data_errors import DataError  # noqa: F401  (raised here; callers import it from app.data too)
from common.config import DataConfig

logger = logging.getLogger("app.data")

_EXTS = (".parquet", ".jsonl", ".json", ".arrow")


def letters_task(n: int, seed: int = 0) -> list[dict]:
    """Toy task for the tiny model: "Say the letter K, not Q or Z." -> "K" (two distractor capitals)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        target, *others = rng.sample(string.ascii_uppercase, 3)
        rows.append({"id": f"letters-{i}", "prompt": f"Say the letter {target}, not {others[0]} or {others[1]}.",
                     "answer": target})
    return rows


def letter_hunt(letters_rows: list[dict], seed: int = 0) -> list[dict]:
    """The multi-turn toy task (app/builtin_envs.LetterHunt) over letters rows: the prompt "Guess my
    letter." says nothing; the answer is the row's target, and `distractors` the two letters the feedback
    names beside it. Ids `hunt-...`."""
    rows = []
    for r in letters_rows:
        target, others = letters_key(r["prompt"])
        rows.append({"id": r["id"].replace("letters", "hunt", 1), "prompt": "Guess my letter.", "answer": target,
                     "distractors": "".join(sorted(others))})
    return rows


# `builtin:letters-heldout` never asks what the first HELDOUT_EXCLUDE prompts of `builtin:letters` (same
# data.shuffle_seed) ask, so it stays disjoint from the training prompts for any data.builtin_size up to it.
HELDOUT_EXCLUDE = 4096
_HELDOUT_SEED_BASE = 1_000_000  # held-out prompts come from another seed range than the training ones


def letters_key(prompt: str) -> tuple[str, frozenset]:
    """What a letters prompt asks: its target and its set of distractors ("K, not Q or Z" = "K, not Z or Q")."""
    m = re.fullmatch(r"Say the letter ([A-Z]), not ([A-Z]) or ([A-Z])\.", prompt)
    if m is None:
        raise ValueError(f"not a letters prompt: {prompt!r}")
    return m.group(1), frozenset(m.group(2, 3))


def letters_heldout(n: int, seed: int = 0, exclude: int = HELDOUT_EXCLUDE) -> list[dict]:
    """n letters prompts, none asking what one of `letters_task(exclude, seed)` asks (nor each other),
    drawn from another seed range; ids `letters-heldout-{i}`."""
    taken = {letters_key(r["prompt"]) for r in letters_task(exclude, seed)}
    space = 26 * 25 * 24 // 2  # (target, {two distractors})
    if n > space - len(taken):
        raise DataError(f"eval: builtin:letters-heldout has {space - len(taken)} prompts, {n} asked for")
    rng = random.Random(_HELDOUT_SEED_BASE + seed)
    rows: list[dict] = []
    while len(rows) < n:
        target, *others = rng.sample(string.ascii_uppercase, 3)
        prompt = f"Say the letter {target}, not {others[0]} or {others[1]}."
        key = letters_key(prompt)
        if key in taken:
            continue
        taken.add(key)
        rows.append({"id": f"letters-heldout-{len(rows)}", "prompt": prompt, "answer": target})
    return rows


# The arithmetic task (`builtin:arith[-1|-2|-1-small][-heldout]`) for real pretrained models: one- or two-step
# word problems, every number in them (operands, intermediate results, answer) a whole number below 100
# (`-1-small`: one step, below 50, for a model that starts too low on the full range). The prompt asks for the
# answer in \boxed{}, which app.rewards' boxed math rewards score.
ARITH_INSTRUCTION = "Put the final answer in \\boxed{}."
_NAMES = ("Tom", "Sara", "Ben", "Mia", "Leo", "Anna", "Sam", "Lily", "Max", "Emma", "Noah", "Zoe", "Jack", "Ella",
          "Omar", "Nina")
_ITEMS = ("apples", "marbles", "stickers", "pencils", "books", "cookies", "cards", "shells", "coins", "stamps")
_BOXES = ("boxes", "bags", "packs", "jars")
# kind -> (template, answer from (a, b, c)); {n} name, {i} item, {x} container.
_ARITH = {
    1: {"add": ("{n} has {a} {i}. {n} gets {b} more. How many {i} does {n} have now?", lambda a, b, c: a + b),
        "sub": ("{n} has {a} {i} and gives {b} of them away. How many {i} does {n} have left?", lambda a, b, c: a - b),
        "mul": ("{n} has {a} {x} with {b} {i} in each. How many {i} does {n} have in all?", lambda a, b, c: a * b),
        "div": ("{n} shares {a} {i} equally among {b} friends. How many {i} does each friend get?",
                lambda a, b, c: a // b)},
    2: {"add-sub": ("{n} has {a} {i}, gets {b} more, then gives {c} away. How many {i} does {n} have now?",
                    lambda a, b, c: a + b - c),
        "sub-add": ("{n} has {a} {i}, gives {b} away, then gets {c} more. How many {i} does {n} have now?",
                    lambda a, b, c: a - b + c),
        "mul-sub": ("{n} has {a} {x} with {b} {i} in each and gives {c} {i} away. How many {i} does {n} have left?",
                    lambda a, b, c: a * b - c),
        "mul-add": ("{n} has {a} {x} with {b} {i} in each and finds {c} more {i}. How many {i} does {n} have now?",
                    lambda a, b, c: a * b + c),
        "add-div": ("{n} has {a} {i}, gets {b} more, then shares them all equally among {c} friends. How many {i} "
                    "does each friend get?", lambda a, b, c: (a + b) // c)},
}


def _arith_numbers(kind: str, rng: random.Random, top: int = 99) -> tuple[int, int, int]:
    """Operands for `kind` with the first step's result and the answer whole and in 1..top (rejection)."""
    first_op = kind.split("-")[0]
    while True:
        c = rng.randint(1, top - 1)
        if first_op == "mul":
            a = rng.randint(2, 9)
            b = rng.randint(2, top // a)
        elif first_op == "div" or kind == "add-div":  # a total that splits evenly among 2..9
            k = rng.randint(2, 9)
            total = k * rng.randint(1, top // k)
            if kind == "div":
                a, b = total, k
            elif total < 2:
                continue
            else:
                a = rng.randint(1, total - 1)
                b, c = total - a, k
        else:
            a, b = rng.randint(2, top), rng.randint(1, top - 1)
        first = {"add": a + b, "sub": a - b, "mul": a * b, "div": a // max(b, 1)}[first_op]
        ans = _ARITH[2 if "-" in kind else 1][kind][1](a, b, c)
        if 1 <= first <= top and 1 <= ans <= top:
            return a, b, c if "-" in kind else 0  # a one-step problem has no third number


def _arith_problem(steps: int, rng: random.Random, top: int = 99) -> tuple[tuple, str, str]:
    """(key, prompt, answer): the key names the arithmetic asked (kind and numbers), not its wording."""
    kind = rng.choice(sorted(_ARITH[steps]))
    a, b, c = _arith_numbers(kind, rng, top)
    template, fn = _ARITH[steps][kind]
    text = template.format(n=rng.choice(_NAMES), i=rng.choice(_ITEMS), x=rng.choice(_BOXES), a=a, b=b, c=c)
    return (kind, a, b, c), f"{text} {ARITH_INSTRUCTION}", str(fn(a, b, c))


def _arith_steps(steps: int | None, rng: random.Random) -> int:
    return steps if steps else rng.choice((1, 2))


# One problem in 8, chosen by a hash of what it asks (kind and numbers, not the wording), is held out: the
# training variants never ask it, whatever their seed and size, and the held-out split has every kind.
_ARITH_HELDOUT_EVERY = 8


def _arith_heldout_key(key: tuple) -> bool:
    return zlib.crc32(repr(key).encode()) % _ARITH_HELDOUT_EVERY == 0


def _arith_rows(n: int, rng: random.Random, steps: int | None, heldout: bool, prefix: str, top: int = 99
                ) -> list[dict]:
    rows: list[dict] = []
    seen: set[tuple] = set()
    for _ in range(1000 * n + 1000):  # rejection sampling, bounded
        if len(rows) == n:
            return rows
        k = _arith_steps(steps, rng)
        key, prompt, answer = _arith_problem(k, rng, top)
        if _arith_heldout_key(key) != heldout or (heldout and key in seen):
            continue  # held-out problems are distinct; training ones may repeat, like any sample
        seen.add(key)
        rows.append({"id": f"{prefix}-{len(rows)}", "prompt": prompt, "answer": answer, "steps": k})
    raise DataError(f"{prefix}: only {len(rows)} distinct held-out problems of {n} asked for")


def arith_task(n: int, seed: int = 0, steps: int | None = None, top: int = 99) -> list[dict]:
    """n training word problems of `steps` steps (1 or 2; None: one or two at random), numbers <= `top`; rows
    carry `steps`."""
    return _arith_rows(n, random.Random(seed), steps, False, "arith", top)


def arith_heldout(n: int, seed: int = 0, steps: int | None = None, top: int = 99) -> list[dict]:
    """n distinct held-out problems: none is ever a training problem of any `builtin:arith*` variant (the
    held-out choice hashes the problem itself, so a small-number problem is held out in every variant)."""
    return _arith_rows(n, random.Random(_HELDOUT_SEED_BASE + seed), steps, True, "arith-heldout", top)


ARITH_SMALL_TOP = 49  # -1-small: ~170 distinct held-out one-step problems, enough for an eval of 128


def _arith_builtins() -> dict:
    out = {}
    for suffix, steps, top in (("", None, 99), ("-1", 1, 99), ("-2", 2, 99), ("-1-small", 1, ARITH_SMALL_TOP)):
        out[f"arith{suffix}"] = lambda n, seed, s=steps, t=top: arith_task(n, seed, s, t)
        out[f"arith{suffix}-heldout"] = lambda n, seed, s=steps, t=top: arith_heldout(n, seed, s, t)
    return out


def _read_arrow(path: Path):
    """An Arrow IPC file: the streaming format `datasets` writes, or the random-access file format."""
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as src:
            return pa.ipc.open_stream(src).read_all()
    except pa.ArrowInvalid:
        with pa.memory_map(str(path)) as src:
            return pa.ipc.open_file(src).read_all()


class Columns:
    """A table's columns as Python lists: from pyarrow (parquet, arrow) or from JSON objects, whose values
    may differ in type from row to row (a number where a string should be is a bad row, not a bad file)."""

    def __init__(self, names: list[str], get, n: int):
        self.names, self._get, self.n = names, get, n

    @classmethod
    def from_arrow(cls, table) -> Columns:
        return cls(table.column_names, lambda c: table.column(c).to_pylist(), table.num_rows)

    @classmethod
    def from_records(cls, records: list[dict]) -> Columns:
        names = list(dict.fromkeys(k for r in records for k in r))
        return cls(names, lambda c: [r.get(c) for r in records], len(records))

    def column(self, name: str) -> list:
        return self._get(name) if name in self.names else [None] * self.n


def _read_json_records(path: Path) -> list[dict]:
    """JSON lines (or, for .json, one array of objects), parsed with the json module."""
    text = path.read_text()
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except ValueError as e:
            raise DataError(f"data.path: cannot read {path} (not valid JSON: {e})") from e
        where = "item"
    else:
        records = []
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except ValueError as e:
                raise DataError(f"data.path: cannot read {path} (line {i}: not valid JSON: {e})") from e
        where = "line"
    for i, r in enumerate(records):
        if not isinstance(r, dict):
            raise DataError(f"data.path: cannot read {path} ({where} {i + 1 if where == 'line' else i}: "
                            f"not a JSON object)")
    return records


def _read_table(path: Path) -> Columns:
    import pyarrow.parquet as pq

    if not path.is_file():
        raise DataError(f"data.path: {path} not found")
    if path.suffix in (".jsonl", ".json"):
        return Columns.from_records(_read_json_records(path))
    try:
        if path.suffix == ".parquet":
            return Columns.from_arrow(pq.read_table(path))
        if path.suffix == ".arrow":
            return Columns.from_arrow(_read_arrow(path))
    except Exception as e:  # pyarrow raises ArrowInvalid and friends on malformed files
        raise DataError(f"data.path: cannot read {path} ({e})") from e
    raise DataError(f"data.path: {path} is neither .parquet, .jsonl, .json nor .arrow")


def _concat(parts: list[Columns]) -> Columns:
    """Files of one split, one after the other; a column one file lacks is null in its rows."""
    if len(parts) == 1:
        return parts[0]
    names = list(dict.fromkeys(n for p in parts for n in p.names))
    return Columns(names, lambda c: [v for p in parts for v in p.column(c)], sum(p.n for p in parts))


def _read_hf_dataset(d: Path):
    """A `datasets` save_to_disk Dataset directory: its arrow shards in state.json's order."""
    try:
        state = json.loads((d / "state.json").read_text())
        files = [d / f["filename"] for f in state.get("_data_files", [])]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"data.path: {d / 'state.json'} is not a `datasets` state file ({e})") from e
    files = files or sorted(d.glob("data-*.arrow"))
    if not files:
        raise DataError(f"data.path: {d} holds no data-*.arrow files")
    parts = []
    for f in files:
        if not f.is_file():
            raise DataError(f"data.path: {f} (listed in state.json) not found")
        try:
            parts.append(Columns.from_arrow(_read_arrow(f)))
        except Exception as e:
            raise DataError(f"data.path: cannot read {f} ({e})") from e
    return _concat(parts)


def _split_of(name: str) -> str:
    """`train-00000-of-00002.parquet` -> train; `test.jsonl` -> test."""
    return re.split(r"[-.]", name, maxsplit=1)[0]


def _split_files(d: Path) -> dict[str, list[Path]]:
    """Split name -> its data files, in DIR and DIR/data: SPLIT.ext, SPLIT-*.ext, SPLIT/*.ext."""
    found: dict[str, list[Path]] = {}
    for base in (d, d / "data"):
        if not base.is_dir():
            continue
        for f in sorted(base.iterdir()):
            if f.is_file() and f.suffix in _EXTS:
                found.setdefault(_split_of(f.name), []).append(f)
            elif f.is_dir() and f.name != "data":
                files = sorted(x for x in f.iterdir() if x.is_file() and x.suffix in _EXTS)
                if files:
                    found.setdefault(f.name, []).extend(files)
    return found


def _resolve(cfg: DataConfig):
    """data.path (+ data.split) -> (Columns, what to call it in messages)."""
    path, split = Path(cfg.path), getattr(cfg, "split", "train")
    if not path.is_dir():
        return _read_table(path), cfg.path
    if (path / "dataset_dict.json").is_file():
        try:
            splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"data.path: {path / 'dataset_dict.json'} is not a `datasets` DatasetDict file "
                            f"({e})") from e
        if split not in splits:
            raise DataError(f"data.split: {split!r} is not a split of {path} (splits: {', '.join(splits)})")
        return _read_hf_dataset(path / split), f"{path} [{split}]"
    if (path / "state.json").is_file():
        return _read_hf_dataset(path), str(path)
    splits = _split_files(path)
    if split not in splits:
        known = ", ".join(sorted(splits)) or "none: no .parquet/.jsonl/.arrow files, dataset_dict.json or state.json"
        raise DataError(f"data.split: no {split!r} data in directory {path} (splits found: {known})")
    files = splits[split]
    return _concat([_read_table(f) for f in files]), f"{path} [{split}]"


def _problem(value, column: str, kind: str) -> str | None:
    """What is wrong with one cell, or None. kind: prompt | answer | id | budget (a completion budget in tokens)."""
    if value is None:
        return f"column {column!r} is missing (null)"
    if kind == "budget" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        return f"column {column!r} must be a positive integer (a completion budget in tokens), got {value!r:.60}"
    if kind == "prompt" and not isinstance(value, str):
        return f"column {column!r} must be a string, got {type(value).__name__} {value!r:.60}"
    if kind in ("prompt", "answer") and isinstance(value, str) and not value.strip():
        return f"column {column!r} is empty"
    if kind == "answer" and isinstance(value, (list, dict)) and not value:
        return f"column {column!r} is empty"
    return None


@dataclass
class PromptLoad:
    """What `load_prompts_with_report` read: the rows kept, and the bad rows skipped (data.on_bad_row=skip)."""
    rows: list[dict]
    skipped: int = 0
    problems: list[str] = field(default_factory=list)  # the first few skipped rows' problems
    source: str = ""


def load_prompts_with_report(cfg: DataConfig) -> PromptLoad:
    """Rows `{"id", "prompt", "answer"}` plus how many bad rows were skipped; raises DataError naming the
    key, split, column or row at fault."""
    if cfg.mix or cfg.path.startswith("reasoning-gym:"):  # generated by reasoning-gym (app/reasoning_gym_tasks.py)
        from app.reasoning_gym_tasks import training_rows
        return PromptLoad(training_rows(cfg), source="data.mix" if cfg.mix else cfg.path)
    if cfg.path.startswith("builtin:"):
        task = cfg.path.split(":", 1)[1]
        builtin = {"letters": letters_task, "letters-heldout": letters_heldout,  # heldout: for eval.path
                   "letter-hunt": lambda n, seed: letter_hunt(letters_task(n, seed)),
                   "letter-hunt-heldout": lambda n, seed: letter_hunt(letters_heldout(n, seed)),
                   **_arith_builtins()}  # arith, arith-1, arith-2 and their -heldout splits
        if task not in builtin:
            raise DataError(f"data.path: unknown builtin task {task!r} (known: {', '.join(builtin)})")
        return PromptLoad(builtin[task](cfg.builtin_size, cfg.shuffle_seed), source=cfg.path)
    table, source = _resolve(cfg)
    cols = table.names
    for key in ("prompt_column", "answer_column", "id_column", "max_tokens_column"):
        col = getattr(cfg, key)
        if col is not None and col not in cols:
            raise DataError(f"data.{key}: column {col!r} is not in {source} (columns: {', '.join(cols)})")
    prompts = table.column(cfg.prompt_column)
    answers = table.column(cfg.answer_column)
    ids = table.column(cfg.id_column) if cfg.id_column else list(range(len(prompts)))
    budgets = table.column(cfg.max_tokens_column) if cfg.max_tokens_column else [None] * len(prompts)
    rows, bad = [], []
    for i, (p, a, pid, budget) in enumerate(zip(prompts, answers, ids, budgets)):
        problem = (_problem(p, cfg.prompt_column, "prompt") or _problem(a, cfg.answer_column, "answer")
                   or (_problem(pid, cfg.id_column, "id") if cfg.id_column else None)
                   or (_problem(budget, cfg.max_tokens_column, "budget") if cfg.max_tokens_column else None))
        if problem:
            bad.append(f"row {i}: {problem}")
            continue
        rows.append({"id": str(pid), "prompt": p, "answer": str(a)})
        if cfg.max_tokens_column:
            rows[-1]["max_new_tokens"] = int(budget)
    if bad and getattr(cfg, "on_bad_row", "error") != "skip":
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        raise DataError(f"{source}: {'; '.join(bad[:5])}{more} ({len(bad)} bad row(s) of {len(prompts)}; "
                        "data.on_bad_row=skip drops them)")
    if not rows:
        skipped = f" left after skipping {len(bad)} bad row(s)" if bad else ""
        raise DataError(f"data.path: {source} has no rows{skipped}")
    return PromptLoad(rows, len(bad), bad[:5], source)


def load_prompts(cfg: DataConfig) -> list[dict]:
    """Rows `{"id", "prompt", "answer"}`; raises DataError naming the key, column or row at fault. Skipped
    bad rows (data.on_bad_row=skip) are logged; `load_prompts_with_report` also returns their count."""
    res = load_prompts_with_report(cfg)
    if res.skipped:
        logger.warning("data: skipped %d bad row(s) of %s (data.on_bad_row=skip): %s%s", res.skipped, res.source,
                       "; ".join(res.problems), " ..." if res.skipped > len(res.problems) else "")
    return res.rows


def render_prompt(row: dict, tokenizer, cfg: DataConfig) -> list[int]:
    """Prompt token ids, through the chat template (with the system prompt) when configured."""
    if cfg.use_chat_template and getattr(tokenizer, "chat_template", None):
        msgs = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
        for ex in cfg.few_shot:
            msgs += [{"role": "user", "content": ex["prompt"]}, {"role": "assistant", "content": ex["answer"]}]
        msgs.append({"role": "user", "content": row["prompt"]})
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    else:
        shots = "".join(f"{ex['prompt']}\n{ex['answer']}\n\n" for ex in cfg.few_shot)
        text = (cfg.system_prompt + "\n" if cfg.system_prompt else "") + shots + row["prompt"]
    return tokenizer(text, add_special_tokens=False)["input_ids"]
