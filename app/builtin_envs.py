"""The embedded multi-turn task, sized for the tiny model (recipes/tiny-multiturn.yaml).

LetterHunt: the user thinks of one of three capital letters ("Guess my letter: Q, K or Z."). A right
first guess scores 1 and ends the episode; a wrong one earns feedback naming the letter among the
distractors ("wrong. say the letter K, not Q or Z."), and the second guess scores 1 if right. The first
guess is a 1-in-3 chance whatever the policy does, so what GRPO can raise is the second turn: reading the
feedback in a conversation that holds its own first answer. The feedback is lowercase but for the letters,
so the only capitals in it are the three candidates.
"""
from __future__ import annotations

import re

_LETTERS = re.compile(r"Guess my letter: ([A-Z]), ([A-Z]) or ([A-Z])\.")


def first_capital(text: str) -> str | None:
    return next((c for c in text if "A" <= c <= "Z"), None)


class LetterHunt:
    def __init__(self, row: dict):
        m = _LETTERS.fullmatch(row["prompt"])
        if m is None or row["answer"] not in m.groups():
            raise ValueError(f"row {row.get('id')!r} is not a letter-hunt row: {row['prompt']!r}")
        self.prompt, self.answer, self.choices = row["prompt"], row["answer"], m.groups()
        self.turn = 0

    def reset(self) -> list[dict]:
        return [{"role": "user", "content": self.prompt}]

    def step(self, assistant_text: str) -> dict:
        self.turn += 1
        if first_capital(assistant_text) == self.answer:
            return {"observations": [], "reward": 1.0, "done": True}
        if self.turn > 1:
            return {"observations": [], "reward": 0.0, "done": True}
        others = [c for c in self.choices if c != self.answer]
        hint = f"wrong. say the letter {self.answer}, not {others[0]} or {others[1]}."
        return {"observations": [{"role": "user", "content": hint}], "reward": 0.0, "done": False}
