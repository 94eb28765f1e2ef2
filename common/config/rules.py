"""The rules that read more than one section, and the checks of this machine (installed packages), each stated
once: other modules call these instead of checking a config rule themselves."""
from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from common.config.base import broken
from common.config.choices import LOGGER_PACKAGES
from common.config.run import VERIFIERS_EVAL

if TYPE_CHECKING:
    from common.config.root import Config


def cross_section_problems(cfg: Config) -> list[str]:
    """The rules that read more than one section; each message names the key to change."""
    model, grpo, train, rollout = cfg.model, cfg.grpo, cfg.train, cfg.rollout
    batch = grpo.prompts_per_step * grpo.group_size
    return broken(
        (grpo.max_new_tokens < model.max_model_len,
         f"grpo.max_new_tokens: {grpo.max_new_tokens} must be < model.max_model_len {model.max_model_len}"),
        (train.max_tokens_per_micro_batch is None or train.max_tokens_per_micro_batch >= model.max_model_len,
         f"train.max_tokens_per_micro_batch: {train.max_tokens_per_micro_batch} is smaller than one sequence "
         f"(model.max_model_len {model.max_model_len}); raise it or lower max_model_len"),
        (batch >= train.num_workers,
         f"grpo.prompts_per_step: {grpo.prompts_per_step} x grpo.group_size {grpo.group_size} = {batch} samples "
         f"per step, fewer than train.num_workers ({train.num_workers}); every worker needs one: raise it or lower "
         "train.num_workers"),
        (rollout.gpus_per_replica == 0 or train.use_gpu,
         "rollout.gpus_per_replica: set but train.use_gpu is false; GPU runs set both (a GPU engine with a CPU "
         "trainer would compute the behaviour and trainer logprobs on different hardware and dtypes)"),
        # merge mode pushes full weights, so only adapter mode is bound by the engines' LoRA slots
        (cfg.sync.mode == "merge" or cfg.lora.rank <= rollout.max_lora_rank,
         f"lora.rank: {cfg.lora.rank} exceeds rollout.max_lora_rank {rollout.max_lora_rank}; raise max_lora_rank "
         "or set sync.mode=merge"),
        (cfg.reward.fn is not None or cfg.env.episodic or cfg.reward.judge.template is not None,
         "reward.fn: null needs env.cls (a multi-turn environment's step rewards) or a judge (reward.judge.template); "
         "single-turn runs need a reward function"),
        (cfg.reward.judge.template is None or cfg.reward.judge.model is not None or cfg.sync.mode == "adapter",
         "reward.judge.model: null judges with the run's base weights (version 0), which sync.mode merge replaces; "
         "use sync.mode adapter or a judge model directory"),
        (cfg.eval.path is None or cfg.reward.fn is not None or cfg.env.episodic,
         "eval.path: evaluation counts a completion correct by reward.fn (reward >= 1), which a judge-only run "
         "(reward.fn null) has not; set eval.path null or a reward.fn"),
        (cfg.env.verifiers is None or cfg.reward.fn is None,
         "reward.fn: a verifiers environment (env.verifiers) scores with its own @vf.reward functions; set "
         "reward.fn: null"),
        (cfg.env.verifiers is None or cfg.eval.path in (None, VERIFIERS_EVAL),
         f"eval.path: a verifiers run (env.verifiers) evaluates on its environment's own tasks: set eval.path: "
         f"{VERIFIERS_EVAL} (held-out tasks, eval.args the taskset's config over env.args) or null"),
        (cfg.eval.path != VERIFIERS_EVAL or cfg.env.verifiers is not None,
         f"eval.path: {VERIFIERS_EVAL} evaluates on the held-out tasks of the run's verifiers environment; set "
         "env.verifiers, or give eval.path a file or builtin set"),
        (cfg.env.cls is None or cfg.reward.where == "worker",
         "reward.where: task runs single-turn rewards only; a multi-turn run (env.cls) scores episodes in the worker"),
        (cfg.env.cls is None or grpo.dapo_overlong_buffer == 0,
         "grpo.dapo_overlong_buffer: the overlong penalty is for single-turn completions; a multi-turn run bounds "
         "episodes with env.max_episode_tokens"),
        (cfg.env.max_episode_tokens is None or cfg.env.max_episode_tokens <= model.max_model_len,
         f"env.max_episode_tokens: {cfg.env.max_episode_tokens} exceeds model.max_model_len {model.max_model_len}"),
        (cfg.sync.max_loras is None or cfg.sync.max_loras >= cfg.adapter_slots,
         f"sync.max_loras: {cfg.sync.max_loras} < {cfg.adapter_slots} adapter slots this run needs (the "
         f"{cfg.sync.live_versions} live versions, one to swap in the next"
         + (", one for the version under evaluation" if cfg.eval.path else "") + "); raise it or leave it null"),
        (not cfg.model.fp32_head or train.zero_stage < 3 or cfg.trainer_dtype == "float32",
         "model.fp32_head: not with train.zero_stage 3 and a bf16/fp16 trainer (the partitioned head shares its "
         "weight with the input embedding, which DeepSpeed still holds gathered at the head); use ZeRO-2"),
        (cfg.run.fleet is None or not cfg.run.serve_after,
         "run.serve_after: a run on a fleet leaves it when it ends (its lease); serve its saved adapter with "
         "`python -m app serve --adapter RUN_DIR/adapter`"),
        (cfg.run.fleet is None or cfg.sync.mode == "adapter",
         "sync.mode: a run on a fleet (run.fleet) must use adapter mode; merge mode replaces the base model that "
         "every run of the fleet shares"),
        (not rollout.partial or cfg.run.mode == "async",
         "rollout.partial: a sync run generates each batch under one version with none published meanwhile, so "
         "nothing would move; use run.mode async or set rollout.partial false"),
        (not rollout.partial or rollout.behaviour_logprobs == "engine",
         "rollout.partial: rollout.behaviour_logprobs trainer scores a sample under the one version it names, and a "
         "continued sample has tokens of several; use rollout.behaviour_logprobs engine"),
        (not rollout.partial or cfg.sync.mode == "adapter",
         "rollout.partial: sync.mode merge replaces the engines' base weights, which a continued sample cannot "
         "move across; use sync.mode adapter"),
        (rollout.behaviour_logprobs == "engine" or train.zero_stage < 3,
         "rollout.behaviour_logprobs: trainer swaps older versions' LoRA values into the parameters, which "
         f"train.zero_stage {train.zero_stage} partitions across ranks; use train.zero_stage 0-2 or "
         "rollout.behaviour_logprobs engine"),
        (cfg.eval.path not in ("builtin:letters-heldout", "builtin:letter-hunt-heldout")
         or cfg.data.builtin_size <= 4096,
         f"eval.path: builtin:letters-heldout is disjoint from the first 4096 builtin:letters prompts only; "
         f"data.builtin_size is {cfg.data.builtin_size}"),
        # vLLM's GPU LoRA kernels (punica, triton) assert float16/bfloat16 inputs: found on an H100, 2026-12-05
        (rollout.gpus_per_replica == 0 or cfg.sync.mode == "merge" or cfg.torch_dtype != "float32",
         "model.dtype: float32 with GPU engines (rollout.gpus_per_replica) and sync.mode adapter: vLLM's GPU LoRA "
         "kernels take float16/bfloat16 only; use model.dtype bfloat16 (or auto) and, for a float32 trainer, "
         "train.dtype float32"),
    )


# The front is a child of the process that starts it, and `fleet up` returns while the fleet stays up.
FLEET_HAS_NO_FRONT = ("rollout.front_port: a fleet has no REST front yet (it would end when `fleet up` returns); "
                      "clients can use the replicas' own ports (rollout.replica_http_port), listed by `fleet status`")


def fleet_problems(cfg: Config) -> list[str]:
    """What a config to start a shared fleet with (`fleet up`) may not set."""
    return broken((cfg.rollout.front_port in (None, 0), FLEET_HAS_NO_FRONT))  # 0, the default: none is started


def machine_problems(cfg: Config) -> list[str]:
    """What this machine lacks for the config: a requested tracker's package, verifiers for env.verifiers, the judge's
    model directory."""
    missing = missing_loggers(cfg.run.loggers) + missing_judge_model(cfg.reward.judge.model)
    if cfg.env.verifiers is not None and importlib.util.find_spec("verifiers") is None:
        missing.append("env.verifiers: needs the `verifiers` package, which is not installed: "
                       "pip install -e \".[envs]\"")
    return missing


def missing_judge_model(path: str | None) -> list[str]:
    """reward.judge.model must be a model directory here (the rollout workers load its tokenizer)."""
    from pathlib import Path

    if path is None or (Path(path) / "config.json").is_file():
        return []
    return [f"reward.judge.model: {path} is not a model directory (no config.json there); null judges with the "
            "run's own base model"]


def missing_loggers(names) -> list[str]:
    """One message per requested logger whose package is not importable."""
    out = []
    for name in names:
        modules, extra = LOGGER_PACKAGES.get(name, ((), ""))
        if modules and not any(importlib.util.find_spec(module) is not None for module in modules):
            out.append(f"run.loggers: {name} needs the `{modules[0]}` package, which is not installed: "
                       f"pip install -e '.[{extra}]' (or pip install {modules[0]})")
    return out


def needs_merge(cfg: Config) -> str | None:
    """Why vLLM cannot serve this adapter as LoRA (then sync falls back to merge), or None."""
    if cfg.lora.use_dora:
        return "DoRA adapters are not servable by vLLM's LoRA path"
    if cfg.lora.modules_to_save:
        return "modules_to_save is not servable by vLLM's LoRA path"
    return None
