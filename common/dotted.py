"""`module:name` references in config (reward.fn, env.cls), imported with errors that name the key."""
from __future__ import annotations

import importlib


def load_dotted(dotted: str, key: str, kind: str) -> object:
    """The object `name` of `module` in `module:name`; ValueError naming `key` when the module does not
    import or has no such `kind` (function, class)."""
    mod_name, _, name = dotted.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"{key}: cannot import module {mod_name!r} ({e})") from e
    obj = getattr(mod, name, None)
    if obj is None:
        raise ValueError(f"{key}: {mod_name} has no {kind} {name!r}")
    return obj
