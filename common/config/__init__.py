"""The one typed config: frozen pydantic sections whose fields carry their help text and constraints, loaded
from YAML plus `--set key=value` overrides. Each section states its own rules beside its fields, the rules that
tie sections together are in `rules`, and every broken rule is one message naming its key (`ConfigError`,
all of them at once). Every field with a fixed set of values is a `Literal` (`choices`), which is what
validation accepts and what `python -m app train --help` (`describe()`) prints.

    choices     the Literals and the tuples other modules import
    base        the Section base class (frozen, strict, unknown keys refused)
    errors      ConfigError; pydantic's errors as one-line messages with suggestions
    model_data, grpo, train, rollout, run   the sections
    root        Config: the sections, derived values (adapter_slots, ...), replace()
    rules       cross-section rules and this machine's checks, one place each
    loading     load / from_dict / apply_overrides / validate
    help        describe()
"""
from common.config.choices import (  # noqa: F401
    LOGGER_PACKAGES,
    LOSS_AGGS,
    ROUTING_POLICIES,
    VLLM_LORA_RANKS,
    BadRowPolicy,
    DType,
    LigerMode,
    LoggerName,
    LoraRank,
    LossAgg,
    LrSchedule,
    MpsPriority,
    PartialPolicy,
    ProxyLocation,
    RewardPlace,
    RouterPolicy,
    RunMode,
    SyncMode,
    TinyShape,
    ZeroStage,
    resolve_dtype,
)
from common.config.errors import ConfigError  # noqa: F401
from common.config.grpo import GRPOConfig  # noqa: F401
from common.config.help import describe  # noqa: F401
from common.config.loading import apply_overrides, from_dict, load, validate  # noqa: F401
from common.config.model_data import DataConfig, LoraConfig, ModelConfig, RewardConfig  # noqa: F401
from common.config.rollout import RolloutConfig, RouterConfig  # noqa: F401
from common.config.root import Config  # noqa: F401
from common.config.rules import fleet_problems, missing_loggers, needs_merge  # noqa: F401
from common.config.run import (  # noqa: F401
    VERIFIERS_EVAL,
    CheckpointConfig,
    EnvConfig,
    EvalConfig,
    RunConfig,
    SyncConfig,
)
from common.config.train import LIGER_ON_NEEDS_GPU, TrainConfig  # noqa: F401
