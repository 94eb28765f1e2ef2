"""The records that cross from rollout to training, and the adapter version naming."""
from __future__ import annotations

import re
from dataclasses import dataclass

POLICY_PREFIX = "policy-v"
POLICY_LATEST = "policy-latest"
_POLICY_RE = re.compile(r"^policy-v(\d+)$")
# A run attached to a fleet serves its adapters as `RUN/policy-vN`; a standalone run is the fleet's run "".
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def policy_name(version: int) -> str:
    """Serving name of a published adapter version. Never reused for other weights."""
    if version < 1:
        raise ValueError(f"policy versions start at 1, got {version}")
    return f"{POLICY_PREFIX}{version}"


def parse_policy_name(name: str) -> int | None:
    """`policy-v7` -> 7; anything else -> None."""
    m = _POLICY_RE.match(name)
    return int(m.group(1)) if m else None


def check_run_name(run: str) -> str:
    """A fleet run's name: letters, digits, `_ . -`, at most 64, starting with a letter or digit ("" is
    the standalone run). Raises ValueError naming the rule."""
    if run != "" and not (isinstance(run, str) and RUN_NAME.fullmatch(run)):
        raise ValueError(f"run name {run!r}: use letters, digits, '_', '.', '-' (at most 64, starting with a "
                         "letter or digit)")
    return run


def adapter_name(version: int, run: str = "") -> str:
    """Serving name of a run's version: `policy-vN` for the standalone run, `RUN/policy-vN` on a fleet."""
    return f"{run}/{policy_name(version)}" if run else policy_name(version)


def latest_name(run: str = "") -> str:
    """The alias of a run's newest live version: `policy-latest` or `RUN/policy-latest`."""
    return f"{run}/{POLICY_LATEST}" if run else POLICY_LATEST


def split_run(name: str) -> tuple[str, str]:
    """`RUN/rest` -> (RUN, rest); a name without a run prefix -> ("", name). The run part is not checked."""
    run, sep, rest = name.partition("/")
    return (run, rest) if sep else ("", name)


def parse_adapter_name(name: str) -> tuple[str, int] | None:
    """`policy-v7` -> ("", 7), `exp-a/policy-v7` -> ("exp-a", 7); anything else -> None."""
    run, rest = split_run(name)
    if run and not RUN_NAME.fullmatch(run):
        return None
    version = parse_policy_name(rest)
    return None if version is None else (run, version)


def lora_int_id(version: int) -> int:
    """vLLM's per-adapter integer id; one per version (version 0 is the base model, no adapter)."""
    return int(version)


def add_segment(segments: list[list[int]], version: int, n: int) -> None:
    """Run-length token provenance ([[version, n_tokens], ...]): `n` more tokens sampled under `version`."""
    if n <= 0:
        return
    if segments and segments[-1][0] == version:
        segments[-1][1] += n
    else:
        segments.append([int(version), int(n)])


@dataclass
class Sample:
    """One scored completion, ready for the GRPO loss. A multi-turn episode is one Sample too: its
    `completion_ids` are every token after the opening prompt (each turn the engine sampled and the
    observations between them), `completion_mask` marks the sampled ones (1) from the context the
    environment added (0), and `behaviour_logprobs` has one entry per completion token (0.0 on context).

    `behaviour_logprobs` is None when the engine sampled without them (`rollout.behaviour_logprobs:
    trainer`): the trainer computes them under `version`'s weights (train_loops/behaviour.py). Inside the
    trainer a list may hold NaN at positions the training forward itself fills (the current version's)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour_logprobs: list[float] | None
    reward: float
    advantage: float
    version: int  # policy version that sampled it
    prompt_id: str = ""
    group_id: str = ""
    completion_mask: list[int] | None = None  # None: every completion token was sampled (single-turn)
    episode: dict | None = None  # multi-turn only: app/episodes.EpisodeStats as a dict
    # rollout.partial: which version sampled each completion token, run-length [[version, n_tokens], ...] summing
    # to len(completion_ids) (a multi-turn episode's context tokens take the version of the turn after them).
    # None: every token is `version`'s.
    token_versions: list[list[int]] | None = None
    resumed: int = 0  # times the engine request moved to a newer version mid-completion
    regenerated_tokens: int = 0  # prompt + kept tokens those moves had to prefill again

    @property
    def last_version(self) -> int:
        """The version the sample was last continued under (its newest token's)."""
        return int(self.token_versions[-1][0]) if self.token_versions else self.version

    @property
    def oldest_version(self) -> int:
        """The version of its oldest token."""
        return min(int(v) for v, _ in self.token_versions) if self.token_versions else self.version

    @property
    def n_versions(self) -> int:
        return len({int(v) for v, _ in self.token_versions}) if self.token_versions else 1

    def per_token_versions(self) -> list[int]:
        """One version per completion token."""
        if not self.token_versions:
            return [self.version] * len(self.completion_ids)
        return [int(v) for v, n in self.token_versions for _ in range(int(n))]

    @property
    def sampled_tokens(self) -> int:
        """Tokens the policy sampled (the ones the loss covers)."""
        return len(self.completion_ids) if self.completion_mask is None else sum(self.completion_mask)


@dataclass
class Group:
    """G samples of one prompt, scored and with group-relative advantages. `version`: the one the buffer's
    staleness rule judges, the samples' common version, or with rollout.partial the version the group finished
    under, its newest token's (docs/ARCHITECTURE.md, "Partial rollouts")."""

    samples: list[Sample]
    version: int
    prompt_id: str
    gen_seconds: float = 0.0
    gen_tokens: int = 0
    epoch: int = 0  # the data epoch its prompt was handed out in (common/data_cursor.py)

    @property
    def oldest_version(self) -> int:
        """The version of the oldest token of any of its samples (what staleness metrics report): the group's
        own version unless a sample was continued across versions (rollout.partial)."""
        return min([self.version, *(s.oldest_version for s in self.samples if s.token_versions)])

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]
