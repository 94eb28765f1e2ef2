"""The whole config: its sections, the values derived from them (computed here once, read everywhere), the
cross-section rules checked when it is built, and `replace` for the copies a run derives from it (a Config is
frozen once validated)."""
from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from common.config.choices import resolve_dtype
from common.config.errors import ConfigError, problems_of
from common.config.grpo import GRPOConfig
from common.config.model_data import DataConfig, LoraConfig, ModelConfig, RewardConfig
from common.config.reasoning_gym import default_reward
from common.config.rollout import RolloutConfig, RouterConfig
from common.config.rules import cross_section_problems
from common.config.run import CheckpointConfig, EnvConfig, EvalConfig, RunConfig, SyncConfig
from common.config.train import TrainConfig


class Config(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)

    def __init__(self, **sections):
        try:
            super().__init__(**sections)
        except ValidationError as error:
            raise ConfigError(problems_of(error, Config)) from None

    @model_validator(mode="before")
    @classmethod
    def _defaults_across_sections(cls, data):
        """Defaults that read another section: reward.fn for reasoning-gym data (`default_reward`)."""
        return default_reward(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _cross_section_rules(self):
        """Runs only once every section is well typed and keeps its own rules."""
        if problems := cross_section_problems(self):
            raise ConfigError(problems)
        return self

    def replace(self, **sections) -> Config:
        """A validated copy with some keys changed, by section: `cfg.replace(rollout={"app_name": "x"})`."""
        data = self.to_dict()
        for name, changes in sections.items():
            if name not in data:
                raise ConfigError([f"{name}: unknown section (known: {', '.join(data)})"])
            data[name].update(changes.model_dump() if isinstance(changes, BaseModel) else changes)
        return Config(**data)

    def to_dict(self) -> dict:
        return self.model_dump()

    # Derived values live here, computed from fields, never stored twice.
    @property
    def adapter_slots(self) -> int:
        """Adapter slots a replica needs for this run: the live versions (`sync.live_versions`), one to swap in
        the next, and with evaluation one for the version under evaluation (held past the live window until
        its evaluation ends). The least sync.max_loras may be, and what a fleet run asks for."""
        return self.sync.live_versions + 1 + (1 if self.eval.path else 0)

    @property
    def replica_slots(self) -> int:
        """Adapter slots each replica holds: sync.max_loras, else `adapter_slots`."""
        return self.sync.max_loras if self.sync.max_loras is not None else self.adapter_slots

    @property
    def scale_advantages(self) -> bool:
        """Divide advantages by the group std: grpo.scale_rewards, never under Dr. GRPO."""
        return self.grpo.scale_rewards and self.grpo.loss != "dr_grpo"

    @property
    def torch_dtype(self) -> str:
        """The engines' dtype (and the trainer's unless train.dtype says otherwise)."""
        return resolve_dtype(self.model.dtype, self.train.use_gpu)

    @property
    def trainer_dtype(self) -> str:
        """The trainer's weights and compute dtype: train.dtype, or the engines' (`torch_dtype`)."""
        return self.torch_dtype if self.train.dtype == "auto" else self.train.dtype

    @property
    def run_dir(self) -> Path:
        return Path(self.run.out_dir) / self.run.name
