"""`describe()`: every key with its type, default and meaning, the manual `python -m app train --help` prints."""
from __future__ import annotations

from common.config.errors import type_name
from common.config.root import Config


def describe() -> str:
    lines = []
    for section_name, section_field in Config.model_fields.items():
        lines.append(f"{section_name}:")
        lines += _keys(section_name, section_field.annotation)
    return "\n".join(lines)


def _keys(prefix: str, section) -> list[str]:
    """One line per key of `section`; a nested section (reward.judge) is a line, then its own keys."""
    from pydantic import BaseModel

    lines = []
    for name, info in section.model_fields.items():
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            lines.append(f"  {prefix}.{name} (section): {info.description or ''}")
            lines += _keys(f"{prefix}.{name}", info.annotation)
            continue
        default = info.get_default(call_default_factory=True)
        lines.append(f"  {prefix}.{name} ({type_name(info.annotation)}, default {default!r}): {info.description or ''}")
    return lines
