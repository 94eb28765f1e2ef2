"""The data cursor that survives restarts: every prompt of an epoch is trained on exactly once,
counted by prompt id, across any number of restarts (a resumed driver, a restored train worker group,
a restarted rollout worker).

Two halves, both plain Python (no Ray), so the rules are unit-tested on their own:

- `ConsumedPrompts`, on the trainer's side: per epoch, the prompt ids the trained steps used. It lives
  in the checkpoint's train_state.json (`state["data"]`), so it is exactly what the checkpointed steps
  consumed: nothing a later, lost step took.
- `PromptSource`, inside the RolloutBuffer actor: the one place prompts are handed out. Each epoch is a
  seeded permutation of all rows (the same for every run with the same seed); `next()` gives
  `(epoch, row)`. Built from a checkpoint's `ConsumedPrompts` it skips exactly the ids those steps used
  and starts at the first epoch they did not finish. A prompt whose group is lost before the trainer
  takes it (a stale group dropped, a failed generation, a dead rollout worker's slot, a step lost with
  a train worker) is `requeue`d and handed out again first, regenerated under the then-current version.
  `rewind(consumed)` (a train worker group restored from a checkpoint) requeues what the trainer took
  since that checkpoint.

Nothing generated before a restart is mixed into the resumed run: its rollouts lived in the old run's
buffer and died with it; their prompts, not in the checkpoint's record, are simply handed out again.
"""
from __future__ import annotations

import random
from collections import deque


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The row order of one epoch: a seeded permutation, a pure function of (n, seed, epoch)."""
    order = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def prompt_key(epoch: int, prompt_id: str) -> str:
    """`epoch:id`, how a step's prompts are written on its metrics row (`prompts`)."""
    return f"{int(epoch)}:{prompt_id}"


def parse_prompt_key(key: str) -> tuple[int, str]:
    epoch, pid = key.split(":", 1)
    return int(epoch), pid


class ConsumedPrompts:
    """Per epoch, the prompt ids trained on. `add` returns False (and counts `repeats`) for an id the
    epoch already had: a replayed prompt, which must never happen."""

    def __init__(self, by_epoch: dict[int, set[str]] | None = None, repeats: int = 0):
        self.by_epoch: dict[int, set[str]] = {int(e): set(ids) for e, ids in (by_epoch or {}).items()}
        self.repeats = repeats

    def add(self, epoch: int, prompt_id: str) -> bool:
        ids = self.by_epoch.setdefault(int(epoch), set())
        if prompt_id in ids:
            self.repeats += 1
            return False
        ids.add(prompt_id)
        return True

    def has(self, epoch: int, prompt_id: str) -> bool:
        return prompt_id in self.by_epoch.get(int(epoch), ())

    def count(self) -> int:
        return sum(len(v) for v in self.by_epoch.values())

    def to_state(self) -> dict:
        """JSON-able: {"epochs": {"0": [ids...], ...}, "repeats": n}."""
        return {"epochs": {str(e): sorted(ids) for e, ids in sorted(self.by_epoch.items())},
                "repeats": self.repeats}

    @classmethod
    def from_state(cls, state: dict | None) -> ConsumedPrompts:
        state = state or {}
        return cls({int(e): set(ids) for e, ids in (state.get("epochs") or {}).items()},
                   int(state.get("repeats", 0)))

    def copy(self) -> ConsumedPrompts:
        return ConsumedPrompts(self.by_epoch, self.repeats)


class PromptSource:
    """Hands out `(epoch, row)`: requeued prompts first, then the epoch order, skipping what `consumed`
    (a checkpoint's record) already trained on; None once `epochs` epochs are handed out.

    `taken` mirrors the trainer's record as this process sees it (what the trainer was given), so
    `rewind` can requeue what steps lost with a failed train worker had taken."""

    def __init__(self, rows: list[dict], seed: int, epochs: int, consumed: ConsumedPrompts | dict | None = None):
        self.rows = rows
        self.by_id = {str(r["id"]): r for r in rows}
        if len(self.by_id) != len(rows):
            raise ValueError("prompt ids are not unique: the data cursor counts prompts by id")
        self.seed, self.epochs = seed, epochs
        if not isinstance(consumed, ConsumedPrompts):
            consumed = ConsumedPrompts.from_state(consumed)
        self.skip = {e: set(ids) for e, ids in consumed.by_epoch.items()}
        self.taken = consumed.copy()
        n = len(rows)
        # Epochs the record finished entirely are over; start at the first one it did not.
        self.epoch = 0
        while self.epoch < epochs and n and len(self.skip.get(self.epoch, ()) & self.by_id.keys()) >= n:
            self.epoch += 1
        self.index = 0
        self._order = epoch_order(n, seed, self.epoch)
        self.requeued: deque[tuple[int, str]] = deque()
        self.handed = 0
        self.requeued_total = 0

    def next(self) -> tuple[int, dict] | None:
        if self.requeued:
            epoch, pid = self.requeued.popleft()
            self.handed += 1
            return epoch, self.by_id[pid]
        while self.epoch < self.epochs:
            if self.index >= len(self._order):
                self.epoch += 1
                self.index = 0
                self._order = epoch_order(len(self.rows), self.seed, self.epoch)
                continue
            row = self.rows[self._order[self.index]]
            self.index += 1
            if str(row["id"]) in self.skip.get(self.epoch, ()):
                continue
            self.handed += 1
            return self.epoch, row
        return None

    def requeue(self, epoch: int, prompt_id: str) -> None:
        """A prompt handed out whose group will never reach the trainer: hand it out again, first."""
        if str(prompt_id) not in self.by_id or (int(epoch), str(prompt_id)) in self.requeued:
            return
        self.requeued.append((int(epoch), str(prompt_id)))
        self.requeued_total += 1

    def take(self, epoch: int, prompt_id: str) -> None:
        """The trainer was given (or, for a filtered group, has accounted for) this prompt."""
        self.taken.add(epoch, str(prompt_id))

    def rewind(self, consumed: ConsumedPrompts | dict | None) -> int:
        """A trainer restored from a checkpoint: prompts taken since (not in its record) come again.
        Returns how many were requeued."""
        if not isinstance(consumed, ConsumedPrompts):
            consumed = ConsumedPrompts.from_state(consumed)
        n = 0
        for e, ids in list(self.taken.by_epoch.items()):
            for pid in sorted(ids - consumed.by_epoch.get(e, set())):
                self.requeue(e, pid)
                n += 1
        self.taken = consumed.copy()
        return n

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "requeued": len(self.requeued), "handed": self.handed,
                "requeued_total": self.requeued_total}
