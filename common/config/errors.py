"""ConfigError, and pydantic's ValidationErrors turned into its messages: one line per problem, naming the key,
the value, what is accepted, and the closest valid key or choice for a misspelt one."""
from __future__ import annotations

import difflib
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

# Keys earlier versions had, and what replaced them.
REMOVED = {"train.grad_accum": "removed: steps are cut into micro-batches by train.max_tokens_per_micro_batch"}

_BOUND_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}


class ConfigError(ValueError):
    """Every broken rule of a config, one line each, naming the key."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid config:\n" + "\n".join(f"  - {problem}" for problem in problems))

    def __reduce__(self):  # crosses Ray's process boundaries with its problems
        return type(self), (self.problems,)


def type_name(annotation) -> str:
    """An annotation as `describe()` and type errors show it."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any:
        return "Any"
    if origin is Literal:
        return " | ".join(str(arg) for arg in args)
    if origin is list and args:
        return f"list of {type_name(args[0])}"
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if arg is type(None) else type_name(arg) for arg in args)
    return getattr(annotation, "__name__", str(annotation))


def bounds(info) -> str:
    """A field's numeric constraints (`Field(ge=..., lt=...)`) as a message states them: `>= 1`, `in (0, 1]`."""
    low = high = None
    for constraint in info.metadata:
        for name, bracket in (("gt", "("), ("ge", "[")):
            if getattr(constraint, name, None) is not None:
                low = (bracket, getattr(constraint, name))
        for name, bracket in (("lt", ")"), ("le", "]")):
            if getattr(constraint, name, None) is not None:
                high = (bracket, getattr(constraint, name))
    if low and high:
        text = f"in {low[0]}{low[1]}, {high[1]}{high[0]}"
    elif low:
        text = f"{'>' if low[0] == '(' else '>='} {low[1]}"
    elif high:
        text = f"{'<' if high[0] == ')' else '<='} {high[1]}"
    else:
        return ""
    return text + (" or null" if _allows_none(info.annotation) else "")


def choices(values) -> str:
    """A Literal's values as an error message lists them: `a or b`, `one of a, b, c`."""
    words = [str(value) for value in values]
    return " or ".join(words) if len(words) == 2 else "one of " + ", ".join(words)


def did_you_mean(word, candidates, qualify: str = "") -> str:
    """` (did you mean X?)` for the closest candidates of a misspelt word, or ``."""
    close = difflib.get_close_matches(str(word), [str(c) for c in candidates], n=2, cutoff=0.6)
    return f" (did you mean {' or '.join(qualify + c for c in close)}?)" if close else ""


def problems_of(error: ValidationError, model: type[BaseModel], prefix: tuple = ()) -> list[str]:
    """The messages of a ValidationError raised validating `model` (at key `prefix`): a rule's own
    ConfigError passes through, every other error becomes one line in the same style."""
    out: list[str] = []
    for item in error.errors():
        nested = (item.get("ctx") or {}).get("error")
        messages = nested.problems if isinstance(nested, ConfigError) else [_message(model, prefix, item)]
        out += [message for message in messages if message not in out]
    return out


def _allows_none(annotation) -> bool:
    return type(None) in typing.get_args(annotation)


def _literal_values(annotation) -> tuple:
    """The values of the Literal inside an annotation (itself, optional, or a list's entries), or ()."""
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    for arg in typing.get_args(annotation):
        if values := _literal_values(arg):
            return values
    return ()


def _is_model(annotation) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _message(model: type[BaseModel], prefix: tuple, item: dict) -> str:
    chain, info, key = [model], None, ".".join(prefix)
    for part in item["loc"]:
        if isinstance(part, int):
            key += f"[{part}]"
            continue
        parent = chain[-1]
        info = parent.model_fields.get(part) if parent is not None else None
        key = f"{key}.{part}" if key else str(part)
        chain.append(info.annotation if info is not None and _is_model(info.annotation) else None)
    kind, value = item["type"], item.get("input")
    if kind == "extra_forbidden":
        return _unknown(chain, key)
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        return f"{key}: must be a mapping of keys, got {type(value).__name__} {value!r}"
    if info is None:
        return f"{key}: {item['msg']}, got {value!r}"
    if kind == "literal_error":
        allowed = _literal_values(info.annotation)
        return f"{key}: {value!r} is not {choices(allowed)}" + did_you_mean(value, allowed)
    if kind == "string_too_short":
        return f"{key}: must not be empty, got {value!r}"
    if kind in _BOUND_ERRORS:
        return f"{key}: must be {bounds(info)}, got {value!r}"
    return f"{key}: expected {type_name(info.annotation)}, got {value!r}"


def _unknown(chain: list, key: str) -> str:
    """An unknown section or key, with the closest valid names (and the section that has this key)."""
    parent, name = chain[-2], key.rsplit(".", 1)[-1]
    if parent is None:
        return f"{key}: unknown key"
    names = list(parent.model_fields)
    if all(_is_model(info.annotation) for info in parent.model_fields.values()):
        hint = did_you_mean(name, names) or f" (known: {', '.join(names)})"
        return f"{key}: unknown section{hint}"
    if removed := REMOVED.get(key):
        return f"{key}: unknown key ({removed})"
    # The key of another section? The sections are the classes beside this one (common.config.base.Section's).
    sections = {getattr(cls, "section", ""): cls for cls in parent.__mro__[1].__subclasses__()}
    elsewhere = [f"{other}.{name}" for other, cls in sections.items() if other and name in cls.model_fields]
    if elsewhere:
        return f"{key}: unknown key (did you mean {' or '.join(elsewhere)}?)"
    return f"{key}: unknown key" + did_you_mean(name, names, qualify=key.rsplit(".", 1)[0] + ".")
