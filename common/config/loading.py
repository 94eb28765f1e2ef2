"""A Config from YAML plus `--set section.key=value` overrides, or from nested dicts (a worker's copy, a run's
config.yaml); `validate` re-checks a built one against this machine too."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from common.config.errors import ConfigError
from common.config.root import Config
from common.config.rules import machine_problems


def from_dict(data: dict | None) -> Config:
    """Build a validated Config from nested dicts; every broken rule (unknown sections or keys, wrong types,
    values out of range, broken rules) is one message of the ConfigError."""
    data = data or {}
    if not isinstance(data, dict):
        raise ConfigError([f"config: top level must be a mapping of sections, got {type(data).__name__}"])
    # A section left empty in YAML (`eval:`) is null: the section's defaults.
    return Config(**{name: values for name, values in data.items() if values is not None})


def validate(cfg: Config) -> None:
    """Raise ConfigError listing every broken rule, including what this machine lacks (a tracker's package);
    checks that need no model files."""
    problems = []
    try:
        cfg = from_dict(cfg.to_dict())
    except ConfigError as error:
        problems += error.problems
    problems += machine_problems(cfg)
    if problems:
        raise ConfigError(problems)


def _coerce(text: str) -> Any:
    """`--set` values are YAML scalars: 3, 0.5, 1e-4, true, null, [q_proj, v_proj], {size: 32}, strings."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:  # not YAML (a judge template such as `{completion} ...`): the text itself
        return text
    if isinstance(value, (dict, list)) and not text.lstrip().startswith(("{", "[")):
        # A block mapping or list is never meant on one line: `Reply Y or N. The reply was: {completion}` is a
        # judge template, not {"Reply Y or N. The reply was": {"completion": None}}. Collections are written {..}/[..].
        return text
    if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    return value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """`data` (nested dicts, changed in place and returned) with each `section.key=value` of `overrides` set."""
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError([f"--set {item!r}: expected key=value (e.g. train.total_steps=10)"])
        key, _, value = item.partition("=")
        parts = key.strip().split(".")
        if len(parts) < 2:
            raise ConfigError([f"--set {key}: keys are section.name (e.g. grpo.lr, reward.judge.template)"])
        where = data
        for part in parts[:-1]:  # a nested section (reward.judge.parse.kind) is a mapping inside its section
            if not isinstance(where.get(part), dict):
                where[part] = {}
            where = where[part]
        where[parts[-1]] = _coerce(value)
    return data


def load(path: str | None = None, overrides: list[str] | None = None) -> Config:
    """YAML file (optional) + overrides -> validated Config. Raises ConfigError."""
    data: dict = {}
    if path:
        file = Path(path)
        if not file.is_file():
            raise ConfigError([f"config file {path}: not found"])
        try:
            data = yaml.safe_load(file.read_text()) or {}
        except yaml.YAMLError as error:
            raise ConfigError([f"config file {path}: not valid YAML ({error})"]) from error
        if not isinstance(data, dict):
            raise ConfigError([f"config file {path}: top level must be a mapping of sections"])
    cfg = from_dict(apply_overrides(data, overrides or []))
    if problems := machine_problems(cfg):
        raise ConfigError(problems)
    return cfg
