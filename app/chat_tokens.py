"""Token-exact multi-turn prompts: a conversation grows by appending tokens, never by re-rendering it.

Turn k's prompt is turn k-1's prompt + the tokens the engine sampled + the tokens of what the template
puts after an assistant message (its end-of-turn text, less what the model already sampled) + the new
messages rendered as a suffix with the generation prompt. Earlier turns are never re-tokenized, so the
trainer sees exactly the tokens the engine saw and produced (the re-tokenization drift TRL #5224, verl
#6501 and prime-rl #1352 describe cannot happen). The suffix is what the chat template renders for the
new messages after a fixed conversation that ends with an assistant message (the approach of verl's and
SkyRL's agent loops): whatever the template does at a message boundary, the suffix reproduces it.
"""
from __future__ import annotations

from dataclasses import dataclass

# A fixed conversation that ends with an assistant message: the suffix of new messages is rendered after it.
_ANCHOR = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]


class TemplateError(ValueError):
    """The chat template cannot render a conversation by appending (its output for a longer
    conversation does not start with its output for a shorter one)."""


@dataclass
class ChatTokens:
    tokenizer: object
    tools: list[dict] | None = None

    def __post_init__(self):
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            raise TemplateError("multi-turn episodes need a tokenizer with a chat template (the model has none)")
        head = self._render(_ANCHOR, generation_prompt=False)
        text = tok.apply_chat_template(_ANCHOR, tokenize=False, tools=self.tools)
        end = text.rfind(_ANCHOR[-1]["content"])
        # What the template writes after an assistant message's content: e.g. "<|im_end|>\n" (Qwen).
        self.turn_close_text = text[end + len(_ANCHOR[-1]["content"]):]
        self._head_len = len(head)
        self._head = head
        self.eos_ids = set(_as_list(getattr(tok, "eos_token_id", None)))

    def _render(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt,
                                                 tools=self.tools, return_dict=False)
        return list(ids)

    def opening(self, messages: list[dict]) -> list[int]:
        """The first prompt: the opening messages and the generation prompt."""
        return self._render(messages, generation_prompt=True)

    def after_turn(self, completion_ids: list[int], new_messages: list[dict]) -> list[int]:
        """Context tokens between a turn the engine sampled (`completion_ids`) and the next turn: the
        rest of the template's end-of-turn text, then `new_messages` and the generation prompt."""
        return self.turn_close(completion_ids) + self.suffix(new_messages)

    def turn_close(self, completion_ids: list[int]) -> list[int]:
        """The end-of-turn text the template puts after an assistant message, less what the model already
        sampled: after a sampled end-of-turn token (EOS) only what follows it ("\\n"); after a turn cut at
        max_tokens all of it."""
        close = self.turn_close_text
        if completion_ids and completion_ids[-1] in self.eos_ids:
            eos_text = self.tokenizer.decode([completion_ids[-1]])
            if close.startswith(eos_text):
                close = close[len(eos_text):]
        return list(self.tokenizer(close, add_special_tokens=False)["input_ids"]) if close else []

    def suffix(self, new_messages: list[dict]) -> list[int]:
        """`new_messages` (observations, tool results) rendered after an assistant message, with the
        generation prompt, as the template renders them inside a whole conversation."""
        full = self._render(_ANCHOR + list(new_messages), generation_prompt=True)
        if full[:self._head_len] != self._head:
            raise TemplateError("the chat template renders a conversation differently when messages follow an "
                                "assistant message; its turns cannot be appended token-exactly")
        return full[self._head_len:]


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple, set)) else [int(value)]
