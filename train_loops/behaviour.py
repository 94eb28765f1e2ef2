"""Behaviour logprobs the trainer computes itself (`rollout.behaviour_logprobs: trainer`; docs/ARCHITECTURE.md,
"Behaviour logprobs from the trainer").

The engine then samples without logprobs (vLLM's per-token logprob work is ~25% of a GPU decode step) and a
sample reaches the trainer with `behaviour_logprobs` None. Its behaviour logprobs are the logprobs of the
weights that sampled it, i.e. of the adapter version it carries:

- the trainer's current version, when the parameters now are exactly what the engines served under it:
  the training forward's own `logp.detach()` (one optimizer step per batch, so the weights have not moved
  yet): no extra forward. `collate` leaves NaN at those positions and `fill_from_forward` takes them.
- an older version: one no-grad forward under that version's LoRA values, which `VersionWeights` keeps for
  the versions the trainer still accepts (`sync.max_staleness`); the values are swapped into the
  parameters (whole on every rank under ZeRO 0-2; ZeRO-3 is refused by the config), the samples go
  through by micro-batches of the token budget, and the current values come back.

The work is planned per (version -> completion positions) (`missing_segments`), so a sample whose tokens
come from several versions (partial rollouts) needs only more segments, not another pass.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from common.types import Sample


def missing_segments(sample: Sample) -> list[tuple[int, int, int]]:
    """(version, start, end): completion positions whose behaviour logprobs the trainer computes, and under
    which version. None for a sample the engine gave logprobs; one segment for a whole sample without."""
    if sample.behaviour_logprobs is not None:
        return []
    return [(sample.version, 0, len(sample.completion_ids))]


class VersionWeights:
    """The LoRA parameter values of the versions the engines served, for the versions the trainer still
    accepts. `live` is the version whose served weights the parameters hold right now (None once they
    moved past every served version: a step off the `sync.every` grid, or a tag within a nonzero
    `sync.delta_threshold`)."""

    def __init__(self, model: torch.nn.Module, max_staleness: int, enabled: bool = True):
        self.enabled = enabled
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.max_staleness = max_staleness
        self.saved: dict[int, dict[str, torch.Tensor]] = {}
        self.live: int | None = None
        self._last_served: int | None = None

    def start(self, version: int) -> None:
        """The parameters now are what the engines serve as `version` (a fresh start, or a restore whose
        version the registry publishes from this checkpoint)."""
        if self.enabled:
            self._store(version)

    def after_step(self, pub: dict) -> None:
        """After the optimizer step and `AdapterPublisher.maybe_publish` (`pub`: its row; the same flags on
        every rank): what the engines will serve under the new version."""
        if not self.enabled:
            return
        version = int(pub["version"])
        if pub.get("published"):
            self._store(version)
        elif pub.get("aliased") and self._last_served in self.saved:
            # a tag serves the last published tensors under the new name
            self.saved[version] = self.saved[self._last_served]
            self._last_served = version
            self.live = version if pub.get("max_delta", 1.0) == 0 else None
        else:  # nothing served under this version; the parameters moved past the last served one
            self.live = None
        for v in [v for v in self.saved if v < version - self.max_staleness]:
            del self.saved[v]

    def _store(self, version: int) -> None:
        self.saved[version] = {n: p.detach().clone() for n, p in self.params.items()}
        self._last_served = self.live = version

    def can_score(self, sample: Sample) -> bool:
        return all(v == self.live or v in self.saved for v, _, _ in missing_segments(sample))

    def swap_in(self, version: int) -> dict[str, torch.Tensor]:
        """Load `version`'s values into the parameters; returns the values they held (for `restore`)."""
        held = {n: p.detach().clone() for n, p in self.params.items()}
        self.restore(self.saved[version])
        return held

    def restore(self, values: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(values[n])


def scoreable(samples: list[Sample], weights: VersionWeights) -> tuple[list[Sample], int]:
    """The samples whose behaviour logprobs exist or can be computed, and how many were dropped (a version
    older than the kept ones: the buffer drops those first, so a count here means a restart or a bug).
    Pure in (samples, weights), so every rank drops the same ones."""
    kept = [s for s in samples if weights.can_score(s)]
    return kept, len(samples) - len(kept)


def prepass(samples: list[Sample], weights: VersionWeights, forward: Callable, collate: Callable,
            pack: Callable, model: torch.nn.Module) -> tuple[dict[int, Sample], dict]:
    """Compute the behaviour logprobs of `samples`' segments of versions other than the live one, each
    version under its kept weights (no grad, eval mode: the engine has no dropout). Returns {id(sample):
    a copy with `behaviour_logprobs` filled (NaN where the live version's training forward fills them)}
    for every sample that lacked them, and the step's `behaviour_*` stats.

    forward(**tensors) -> (logp, entropy); collate(samples) -> tensors; pack(samples) -> micro-batches."""
    t0 = time.perf_counter()
    todo = [s for s in samples if missing_segments(s)]
    filled = {id(s): [math.nan] * len(s.completion_ids) for s in todo}
    by_version: dict[int, list[tuple[Sample, int, int]]] = {}
    for s in todo:
        for version, start, end in missing_segments(s):
            if version != weights.live:
                by_version.setdefault(version, []).append((s, start, end))
    was_training = model.training
    for version, segments in sorted(by_version.items()):
        held = weights.swap_in(version)
        model.eval()
        try:
            ranges = {id(s): (start, end) for s, start, end in segments}
            for part in pack(list({id(s): s for s, _, _ in segments}.values())):
                tensors = collate(part)
                with torch.no_grad():
                    logp, _ = forward(**{k: tensors[k] for k in ("input_ids", "attention_mask", "pred_pos",
                                                                  "targets", "mask")})
                logp = logp.float().cpu()
                for row, s in enumerate(part):
                    start, end = ranges[id(s)]
                    filled[id(s)][start:end] = logp[row, start:end].tolist()
        finally:
            weights.restore(held)
            model.train(was_training)
    out = {id(s): replace(s, behaviour_logprobs=filled[id(s)]) for s in todo}
    stats = {"behaviour_trainer_samples": len(todo),
             "behaviour_prepass_samples": sum(len(v) for v in by_version.values()),
             "behaviour_prepass_seconds": time.perf_counter() - t0}
    return out, stats


def fill_from_forward(behaviour: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """The behaviour logprobs with every NaN (a position of the live version) replaced by the training
    forward's own logprob, detached: the ratio there is exactly 1 and the gradient the on-policy one."""
    missing = torch.isnan(behaviour)
    if not bool(missing.any()):
        return behaviour
    return torch.where(missing, logp.detach().to(behaviour.dtype), behaviour)
