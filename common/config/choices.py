"""The fixed sets of values config fields take, each one `Literal`: what validation accepts, what `train --help`
prints, and what other modules import (the tuples)."""
from __future__ import annotations

import typing
from typing import Literal

# model.dtype; `auto` is resolved by `resolve_dtype` (the only place that decides it).
DType = Literal["auto", "float32", "bfloat16", "float16"]
# model.tiny_shape: the shapes app/tiny_model.SHAPES builds (tests/test_config.py ties the two).
TinyShape = Literal["tiny", "small", "qwen2.5-1.5b"]
BadRowPolicy = Literal["error", "skip"]
RewardPlace = Literal["worker", "task"]
# reward.judge.parse.kind: how app/judge.py reads a judge's reply.
JudgeParseKind = Literal["score", "words"]
LrSchedule = Literal["constant", "cosine"]
# grpo.loss_agg: how grpo and cispo reduce per-token losses over a step; train_loops/losses.py imports LOSS_AGGS.
LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
LOSS_AGGS: tuple[str, ...] = typing.get_args(LossAgg)
LigerMode = Literal["auto", "on", "off"]
MpsPriority = Literal["normal", "below_normal"]
ZeroStage = Literal[0, 1, 2, 3]
# rollout.max_lora_rank: the ranks vLLM accepts (vllm/config/lora.py MaxLoRARanks).
LoraRank = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]
VLLM_LORA_RANKS: tuple[int, ...] = typing.get_args(LoraRank)
# router.policy: prefix affinity or round robin (serve_deployments/request_router.RoutingPolicy), or Serve's own
# router; request_router imports ROUTING_POLICIES.
RouterPolicy = Literal["prefix", "round_robin", "serve_default"]
ROUTING_POLICIES: tuple[str, ...] = typing.get_args(RouterPolicy)
SyncMode = Literal["adapter", "merge"]
# rollout.partial_policy: which partial rollouts move to a newer version (serve_deployments/partial_rollouts.py)
PartialPolicy = Literal["at_limit", "all"]
BehaviourLogprobs = Literal["engine", "trainer"]
RunMode = Literal["async", "sync"]
ProxyLocation = Literal["EveryNode", "HeadOnly", "Disabled"]  # ray.serve.config.ProxyLocation
# run.loggers entries -> (modules, any one of which will do; the pip extra that installs them). See app/loggers.py.
LoggerName = Literal["jsonl", "tensorboard", "mlflow", "wandb"]
LOGGER_PACKAGES: dict[LoggerName, tuple[tuple[str, ...], str]] = {
    "jsonl": ((), ""), "tensorboard": (("tensorboard", "tensorboardX"), "tracking"),
    "mlflow": (("mlflow",), "tracking"), "wandb": (("wandb",), "wandb")}
if tuple(LOGGER_PACKAGES) != typing.get_args(LoggerName):
    raise RuntimeError(f"LOGGER_PACKAGES covers {tuple(LOGGER_PACKAGES)}, LoggerName is {typing.get_args(LoggerName)}")


def words(literal, separator: str = " | ") -> str:
    """A Literal's values as help text shows them."""
    return separator.join(str(value) for value in typing.get_args(literal))


def resolve_dtype(dtype: str, use_gpu: bool) -> str:
    """The torch/vLLM dtype of `model.dtype`: `auto` is bfloat16 when training on GPUs (`train.use_gpu`), else
    float32. The engines use it, and the trainer too unless `train.dtype` names its own (`Config.trainer_dtype`)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if use_gpu else "float32"
