"""What every config section shares: frozen pydantic models whose fields carry their help text and constraints
(`option`), strict types (YAML gives typed values), unknown keys refused, and the section's own rules (`problems`)
checked once its fields are well typed. Building a section directly raises ConfigError like loading does."""
from __future__ import annotations

import typing
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from common.config.errors import ConfigError, problems_of


def option(default, help: str, **constraints):
    """A field with its default, help text and numeric constraints (ge, gt, le, lt); list and dict defaults are
    copied per instance."""
    if isinstance(default, (list, dict)):
        return Field(default_factory=lambda value=default: type(value)(value), description=help, **constraints)
    return Field(default=default, description=help, **constraints)


def broken(*rules: tuple[bool, str]) -> list[str]:
    """The messages of the rules (holds, message) that do not hold."""
    return [message for holds, message in rules if not holds]


class Section(BaseModel):
    """One section of the config (`section` is its key); subclasses add fields and override `problems`."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)
    section: ClassVar[str] = ""

    def __init__(self, **values):
        try:
            super().__init__(**values)
        except ValidationError as error:
            raise ConfigError(problems_of(error, type(self), (type(self).section,))) from None

    @model_validator(mode="before")
    @classmethod
    def _yaml_words(cls, data):
        """YAML 1.1 reads `off` / `on` as booleans (in files and in --set alike); a field whose allowed words
        include them gets the word back."""
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for name, value in data.items():
            info = cls.model_fields.get(name)
            if (isinstance(value, bool) and info is not None and typing.get_origin(info.annotation) is Literal
                    and ("on" if value else "off") in typing.get_args(info.annotation)):
                out[name] = "on" if value else "off"
        return out

    @model_validator(mode="after")
    def _own_rules(self):
        if problems := self.problems():
            raise ConfigError(problems)
        return self

    def problems(self) -> list[str]:
        """The section's rules that tie its fields together (single-field bounds are the fields' own)."""
        return []

    def replace(self, **changes):
        """A copy with `changes`, validated like a loaded section."""
        return type(self)(**{**self.model_dump(), **changes})
