"""Section grpo: the policy loss, its clip ranges, the optimizer's learning rate and the sampling."""
from __future__ import annotations

from common.config.base import Section, broken, option
from common.config.choices import LossAgg, LrSchedule
from common.loss_names import POLICY_LOSSES, PolicyLossName


class GRPOConfig(Section):
    section = "grpo"
    group_size: int = option(8, "Completions sampled per prompt (G); >= 2, advantages are relative within a group.",
                             ge=2)
    prompts_per_step: int = option(8, "Prompts per optimizer step (batch = prompts_per_step x group_size).", ge=1)
    lr: float = option(1e-3, "AdamW learning rate over the LoRA parameters.", gt=0)
    lr_schedule: LrSchedule = option(
        "constant", "constant: grpo.lr throughout; cosine: from grpo.lr down to grpo.min_lr_ratio x lr at "
                    "train.total_steps (after any warmup). Kept in checkpoints, so a resume continues it.")
    warmup_steps: int = option(0, "Optimizer steps over which the lr rises linearly to grpo.lr (0 = none).", ge=0)
    min_lr_ratio: float = option(0.1, "cosine: the final lr as a fraction of grpo.lr.", ge=0, le=1)
    weight_decay: float = option(0.0, "AdamW weight decay.")
    loss: PolicyLossName = option("grpo", "Policy loss (train_loops/losses.py), one of:\n"
                                  + "\n".join(f"      {name}: {text}" for name, text in POLICY_LOSSES.items()))
    clip_eps_low: float = option(0.2, "PPO clip: ratio lower bound 1 - eps_low.", gt=0, lt=1)
    clip_eps_high: float = option(0.2, "PPO clip: ratio upper bound 1 + eps_high (DAPO clip-higher when larger).",
                                  gt=0)
    kl_coef: float = option(0.0, "KL to the base policy (adapter disabled); 0 skips the reference forward.", ge=0)
    tis_cap: float | None = option(None, "Truncated importance sampling cap on trainer/behaviour ratio; null = off "
                                         "(losses grpo, dr_grpo, dapo).", ge=1)
    scale_rewards: bool = option(True, "Divide advantages by the group std (always off under loss dr_grpo).")
    loss_agg: LossAgg = option(
        "token-mean", "The reduction of losses grpo and cispo over a step (dr_grpo, gspo and dapo have their own).")
    gspo_clip_eps_low: float = option(3e-4, "gspo: sequence ratio lower bound 1 - eps (GSPO's ranges are tiny).",
                                      gt=0, lt=1)
    gspo_clip_eps_high: float = option(4e-4, "gspo: sequence ratio upper bound 1 + eps.", gt=0)
    cispo_eps_low: float = option(1.0, "cispo: IS weight lower bound 1 - eps (1.0 = none, as in MiniMax-M1).",
                                  gt=0, le=1)
    cispo_eps_high: float = option(0.28, "cispo: IS weight upper bound 1 + eps.", gt=0)
    dapo_clip_eps_low: float = option(0.2, "dapo: ratio lower bound 1 - eps.", gt=0, lt=1)
    dapo_clip_eps_high: float = option(0.28, "dapo: ratio upper bound 1 + eps (clip-higher: > dapo_clip_eps_low).",
                                       gt=0)
    dr_grpo_norm_len: int | None = option(None, "dr_grpo: the constant each sequence's token sum is divided by; "
                                                "null = grpo.max_new_tokens.", ge=1)
    dapo_overlong_buffer: int = option(0, "Overlong reward shaping (any loss): completions longer than "
                                          "max_new_tokens - buffer get a penalty growing linearly to "
                                          "-dapo_overlong_penalty at max_new_tokens; 0 = off.", ge=0)
    dapo_overlong_penalty: float = option(1.0, "Overlong shaping: the penalty at max_new_tokens.", ge=0)
    dynamic_sampling: bool = option(False, "Drop groups whose rewards are all equal (no learning signal) and sample "
                                           "new ones in their place (DAPO); counted as filtered_groups.")
    temperature: float = option(1.0, "Sampling temperature.", gt=0)
    top_p: float = option(1.0, "Sampling top-p (nucleus). The trainer's logprobs, and the KL reference's, are taken "
                               "under the same truncated distribution vLLM samples from "
                               "(train_loops/head_logprobs.py), so the importance ratio stays unbiased.", gt=0, le=1)
    ignore_eos: bool = option(False, "Generate exactly max_new_tokens per completion (speed benchmarks; "
                                     "length-controlled runs). The reward scores the reply up to the model's "
                                     "first end-of-sequence token; every token is trained.")
    max_new_tokens: int = option(16, "Max completion tokens.", ge=1)

    def problems(self) -> list[str]:
        return broken(
            (self.tis_cap is None or self.loss in ("grpo", "dr_grpo", "dapo"),
             f"grpo.tis_cap: applies to losses grpo, dr_grpo and dapo; {self.loss} weights by the behaviour ratio "
             f"itself: set grpo.tis_cap=null (got {self.tis_cap})"),
            (self.dapo_overlong_buffer < self.max_new_tokens,
             f"grpo.dapo_overlong_buffer: must be < grpo.max_new_tokens ({self.max_new_tokens}), "
             f"got {self.dapo_overlong_buffer}"),
        )
