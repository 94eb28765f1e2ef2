"""`describe()`: every key with its type, default and meaning, the manual `python -m app train --help` prints."""
from __future__ import annotations

from common.config.errors import type_name
from common.config.root import Config


def describe() -> str:
    lines = []
    for section_name, section_field in Config.model_fields.items():
        lines.append(f"{section_name}:")
        for name, info in section_field.annotation.model_fields.items():
            default = info.get_default(call_default_factory=True)
            lines.append(f"  {section_name}.{name} ({type_name(info.annotation)}, default {default!r}): "
                         f"{info.description or ''}")
    return "\n".join(lines)
