"""Re-tokenization detector: in a token-exact episode every turn's prompt starts with the previous turn's prompt
followed by the tokens sampled in that turn. A turn whose prompt does not (its client rendered the conversation
to text and tokenized it again, and the ids drifted) is not what the engine sampled in context: the trainer must
not treat its ids as the behaviour policy's."""
from __future__ import annotations


def extends(previous_prompt: list[int], previous_completion: list[int], prompt: list[int]) -> bool:
    """Whether `prompt` starts with `previous_prompt + previous_completion`."""
    head = list(previous_prompt) + list(previous_completion)
    return len(prompt) >= len(head) and list(prompt[:len(head)]) == head


def retokenized_turns(turns: list[dict]) -> list[int]:
    """The 1-based numbers of the turns (dicts with `prompt_ids` and `token_ids`, app/episodes.Episode.turns)
    whose prompt does not extend the turn before."""
    return [k + 1 for k in range(1, len(turns))
            if not extends(turns[k - 1]["prompt_ids"], turns[k - 1]["token_ids"], turns[k]["prompt_ids"])]
