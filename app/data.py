"""Prompts: parquet/JSONL (pyarrow) or the builtin toy task, a column map, a seeded per-epoch shuffle
and a resumable cursor. Bad files, missing columns and bad rows fail here, before any actor starts."""
from __future__ import annotations

import random
import string
from dataclasses import dataclass
from pathlib import Path

from common.config import DataConfig


class DataError(ValueError):
    pass


def letters_task(n: int, seed: int = 0) -> list[dict]:
    """Toy task for the tiny model: "Say the letter K, not Q or Z." -> "K" (two distractor capitals)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        target, *others = rng.sample(string.ascii_uppercase, 3)
        rows.append({"id": f"letters-{i}", "prompt": f"Say the letter {target}, not {others[0]} or {others[1]}.",
                     "answer": target})
    return rows


def _read_table(path: Path):
    import pyarrow.json as pj
    import pyarrow.parquet as pq

    if not path.is_file():
        raise DataError(f"data.path: {path} not found")
    try:
        if path.suffix == ".parquet":
            return pq.read_table(path)
        if path.suffix in (".jsonl", ".json"):
            return pj.read_json(path)
    except Exception as e:  # pyarrow raises ArrowInvalid and friends on malformed files
        raise DataError(f"data.path: cannot read {path} ({e})") from e
    raise DataError(f"data.path: {path} is neither .parquet nor .jsonl")


def load_prompts(cfg: DataConfig) -> list[dict]:
    """Rows `{"id", "prompt", "answer"}`; raises DataError naming the key, column or row at fault."""
    if cfg.path.startswith("builtin:"):
        task = cfg.path.split(":", 1)[1]
        if task != "letters":
            raise DataError(f"data.path: unknown builtin task {task!r} (known: letters)")
        return letters_task(cfg.builtin_size, cfg.shuffle_seed)
    table = _read_table(Path(cfg.path))
    cols = table.column_names
    for key in ("prompt_column", "answer_column", "id_column"):
        col = getattr(cfg, key)
        if col is not None and col not in cols:
            raise DataError(f"data.{key}: column {col!r} is not in {cfg.path} (columns: {', '.join(cols)})")
    prompts = table.column(cfg.prompt_column).to_pylist()
    answers = table.column(cfg.answer_column).to_pylist()
    ids = table.column(cfg.id_column).to_pylist() if cfg.id_column else list(range(len(prompts)))
    rows = []
    for i, (p, a, pid) in enumerate(zip(prompts, answers, ids)):
        if not isinstance(p, str) or not p.strip():
            raise DataError(f"{cfg.path} row {i}: column {cfg.prompt_column!r} must be a non-empty string, got {p!r}")
        if a is None:
            raise DataError(f"{cfg.path} row {i}: column {cfg.answer_column!r} is null")
        rows.append({"id": str(pid), "prompt": p, "answer": str(a)})
    if not rows:
        raise DataError(f"data.path: {cfg.path} has no rows")
    return rows


@dataclass
class Cursor:
    epoch: int = 0
    index: int = 0


class PromptStream:
    """Endless, seeded, epoch-shuffled stream over the rows, with a cursor that can be saved/restored."""

    def __init__(self, rows: list[dict], seed: int, epochs: int, cursor: Cursor | None = None):
        self.rows, self.seed, self.epochs = rows, seed, epochs
        self.cursor = cursor or Cursor()
        self._order = self._perm(self.cursor.epoch)

    def _perm(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self.cursor.index >= len(self.rows):
            self.cursor = Cursor(self.cursor.epoch + 1, 0)
            self._order = self._perm(self.cursor.epoch)
        if self.cursor.epoch >= self.epochs:
            raise StopIteration
        row = self.rows[self._order[self.cursor.index]]
        self.cursor.index += 1
        return row


def render_prompt(row: dict, tokenizer, cfg: DataConfig) -> list[int]:
    """Prompt token ids, through the chat template (with the system prompt) when configured."""
    if cfg.use_chat_template and getattr(tokenizer, "chat_template", None):
        msgs = ([{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []) + \
               [{"role": "user", "content": row["prompt"]}]
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    else:
        text = (cfg.system_prompt + "\n" if cfg.system_prompt else "") + row["prompt"]
    return tokenizer(text, add_special_tokens=False)["input_ids"]
