"""Sections model, data, reward and lora: what is trained, on which prompts, scored how, adapted where."""
from __future__ import annotations

from typing import Any

from common.config.base import Section, broken, option
from common.config.choices import BadRowPolicy, DType, RewardPlace, TinyShape, words
from common.config.judge import JudgeConfig
from common.config.reasoning_gym import REASONING_GYM, REASONING_GYM_REWARDS, AnswerExtract, mix_entry_ok


class ModelConfig(Section):
    section = "model"
    path: str = option("runs/tiny-model", "HF model directory (any causal LM vLLM and transformers load).")
    build_tiny: bool = option(True, "Build the embedded tiny model at `path` if the directory does not exist.")
    tiny_seed: int = option(0, "Seed of the embedded tiny model (weights are a pure function of it).")
    tiny_shape: TinyShape = option("tiny", f"Shape of the embedded model built at `path`: {words(TinyShape)} "
                                           "(`python -m app tiny-model --help`).")
    dtype: DType = option(
        "auto", "Weights and compute dtype of trainer and engines; auto = bfloat16 when train.use_gpu, "
                "else float32 (`resolve_dtype`).")
    max_model_len: int = option(512, "Context length for the engines and the trainer (prompt + completion).", ge=16)
    fp32_head: bool = option(
        False, "Compute the LM head's logits in float32 on both sides: the engines (vLLM hf_overrides head_dtype="
               "float32) and the trainer (train_loops/head_logprobs.py). With a bfloat16/float16 model each side "
               "rounds its logits to half precision, part of the trainer/vLLM logprob mismatch (the importance "
               "ratio's noise; on CPU, Gemma 3 270M: mean |diff| 0.0236 -> 0.0199). Costs a float32-result logits "
               "matmul (off CUDA a float32 copy of the head weight per forward). Needs a vLLM that honours "
               "head_dtype for generation models (vLLM 0.32, both builds, does; an older one is refused). No effect "
               "on a float32 model.")


class DataConfig(Section):
    section = "data"
    path: str = option(
        "builtin:letters", "Prompts: a .parquet or .jsonl file, a directory of split files or written by "
                           "`datasets` save_to_disk (see `split`), `builtin:letters` (toy task), or "
                           "`reasoning-gym:TASK` (a reasoning-gym task, its config in `args`; docs/TASKS.md).")
    args: dict = option(
        {}, "reasoning-gym only: the task's config for `path: reasoning-gym:TASK` (`size`, default builtin_size; "
            "`seed`, default shuffle_seed; and the task's own keys), or `size` and `seed` of a `mix`.")
    mix: list[dict] = option(
        [], "reasoning-gym tasks mixed by weight, instead of `path`: `[{path: reasoning-gym:TASK, weight: W, "
            "args: {...}}, ...]`; each task gets its weight's share of `args.size` items (metrics: reward/TASK).")
    prompt_column: str = option("prompt", "Column holding the prompt text.")
    answer_column: str = option("answer", "Column holding the reference answer given to the reward.")
    id_column: str | None = option(None, "Optional column with a stable prompt id (row index otherwise).")
    max_tokens_column: str | None = option(
        None, "Optional column with a row's own completion budget, a positive integer (capped at "
              "grpo.max_new_tokens): long-tailed lengths, as `benchmarks/bench_length_tail.py` draws them.")
    system_prompt: str | None = option(None, "System message put before every prompt by the chat template.")
    few_shot: list[dict] = option(
        [], "Solved examples put before every prompt as earlier turns, each `{prompt: ..., answer: ...}` (a user "
            "turn, then the assistant's answer, through the chat template): how a pretrained, not "
            "instruction-tuned, model learns the answer format.")
    use_chat_template: bool = option(True, "Render prompts with the tokenizer's chat template.")
    shuffle_seed: int = option(0, "Seed of the per-epoch shuffle.")
    epochs: int = option(100, "Passes over the data (training stops at train.total_steps anyway).", ge=1)
    builtin_size: int = option(256, "Number of prompts the builtin task generates.", ge=1)
    split: str = option(
        "train", "Split to read when `path` holds several: a `datasets` save_to_disk DatasetDict, or "
                 "a directory of SPLIT.parquet / SPLIT.jsonl / SPLIT-*.parquet files.")
    on_bad_row: BadRowPolicy = option(
        "error", "A row with a missing/null column, a non-string or empty prompt or an empty answer: "
                 "`error` refuses the data (naming row, column, problem), `skip` drops and counts it.")

    def problems(self) -> list[str]:
        gym = self.path.startswith(REASONING_GYM)
        return broken(
            (not self.args or gym or bool(self.mix),
             "data.args: a reasoning-gym task's config; data.path is not reasoning-gym:TASK and data.mix is empty"),
            (not self.mix or self.path == DataConfig.model_fields["path"].default,
             f"data.mix: replaces data.path; leave data.path unset (it is {self.path!r})"),
            (not self.mix or set(self.args) <= {"size", "seed"},
             f"data.args: with data.mix only size and seed (the tasks' own keys go in their mix entry's args), "
             f"got {sorted(self.args)}"),
            *((mix_entry_ok(m),
               f"data.mix[{i}]: expected {{path: reasoning-gym:TASK, weight: number > 0, args: {{...}}}}, got {m!r}")
              for i, m in enumerate(self.mix)),
            (len({str(m.get("path", "")).strip() for m in self.mix if isinstance(m, dict)}) == len(self.mix),
             "data.mix: a task appears twice; give each task one entry (its weight and args)"),
            (bool(self.split) and "/" not in self.split,
             f"data.split: {self.split!r} is not a split name (a name like train or test, without '/')"),
            *((set(ex) == {"prompt", "answer"} and all(isinstance(v, str) and v for v in ex.values()),
               f"data.few_shot[{i}]: expected {{prompt: text, answer: text}}, got {ex!r}")
              for i, ex in enumerate(self.few_shot)),
        )


class RewardConfig(Section):
    section = "reward"
    fn: str | None = option(
        "app.rewards:letter_reward", "Reward function `module:function(completion, answer, prompt) -> float`; "
                                     "it also gets the data row (`row=`, every column), vLLM's "
                                     "`finish_reason=` (stop | length) and, in a multi-turn run, the episode "
                                     "(`trajectory=`) when it accepts those keywords. null (multi-turn only): "
                                     "an episode's reward is the sum of its environment's step rewards.")
    where: RewardPlace = option("worker", "Run rewards in the rollout worker (`worker`) or as Ray tasks (`task`).")
    extract: AnswerExtract | None = option(
        None, "reasoning-gym data: what part of the completion the task's own checker scores: `answer_tag` "
              "(the last <answer>...</answer>; the default), `boxed` (the last \\boxed{}), `first_boxed` (the first: "
              "a pretrained model that writes on after answering) or `none` (all of it). "
              "With reasoning-gym data and reward.fn unset, reward.fn becomes that checker (docs/TASKS.md).")
    fn_weight: float = option(1.0, "reward.fn's weight in the reward when a judge scores too (reward.judge.weight).",
                              ge=0)
    judge: JudgeConfig = option(JudgeConfig(), "A generative judge's score, added to reward.fn's (docs/TASKS.md, "
                                               "\"Judge rewards\"); off until reward.judge.template is set.")

    def problems(self) -> list[str]:
        return broken((self.fn is None or ":" in self.fn,
                       f"reward.fn: {self.fn!r} is not `module:function` (e.g. app.rewards:letter_reward)"),
                      (self.extract is None or self.fn == REASONING_GYM_REWARDS[self.extract],
                       f"reward.extract: {self.extract} picks the reasoning-gym reward, but reward.fn is {self.fn!r}: "
                       "leave reward.fn unset"))


class LoraConfig(Section):
    section = "lora"
    rank: int = option(8, "LoRA rank r.", gt=0)
    alpha: float = option(16.0, "LoRA alpha (scaling = alpha / rank).", gt=0)
    dropout: float = option(0.0, "LoRA dropout.", ge=0, lt=1)
    target_modules: Any = option("all-linear", "Module names (list, e.g. [q_proj, v_proj]) or `all-linear`.")
    use_dora: bool = option(False, "DoRA (vLLM cannot serve it: forces merge sync).")
    modules_to_save: list = option([], "Extra trained full modules (vLLM cannot serve them: forces merge sync).")

    def problems(self) -> list[str]:
        modules = self.target_modules
        return broken(
            (modules == "all-linear"
             or (isinstance(modules, list) and bool(modules) and all(isinstance(name, str) for name in modules)),
             f"lora.target_modules: must be `all-linear` or a non-empty list of module names, got {modules!r}"),
        )
