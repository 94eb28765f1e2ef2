"""The embedded multi-turn task, sized for the tiny model (recipes/tiny-multiturn.yaml).

LetterHunt: the user thinks of a capital letter and says only "Guess my letter." A right first guess
(a 1-in-26 fluke) scores 1 and ends the episode; a wrong one earns feedback that names the letter between
two distractors ("wrong. say the letter K, not Q or Z."), and the second guess scores 1 if right. The
answer is reachable only through the feedback, and what GRPO can raise is the second turn: reading the
feedback in a conversation that holds the model's own first answer. The feedback is lowercase but for
the letters, so the only capitals in it are the answer and its distractors.
"""
from __future__ import annotations


def first_capital(text: str) -> str | None:
    return next((c for c in text if "A" <= c <= "Z"), None)


class LetterHunt:
    def __init__(self, row: dict):
        answer, others = row.get("answer"), str(row.get("distractors", ""))
        if not (isinstance(answer, str) and len(answer) == 1 and answer.isupper() and len(others) == 2):
            raise ValueError(f"row {row.get('id')!r} is not a letter-hunt row (answer: one capital, distractors: "
                             f"two): {row}")
        self.prompt, self.answer, self.others = row["prompt"], answer, others
        self.turn = 0

    def reset(self) -> list[dict]:
        return [{"role": "user", "content": self.prompt}]

    def step(self, assistant_text: str) -> dict:
        self.turn += 1
        if first_capital(assistant_text) == self.answer:
            return {"observations": [], "reward": 1.0, "done": True}
        if self.turn > 1:
            return {"observations": [], "reward": 0.0, "done": True}
        hint = f"wrong. say the letter {self.answer}, not {self.others[0]} or {self.others[1]}."
        return {"observations": [{"role": "user", "content": hint}], "reward": 0.0, "done": False}
