"""The one typed config: dataclasses whose fields carry their help text, loaded from YAML plus
`--set key=value` overrides, validated in one place (`validate`), every broken rule one message that
names its key. `python -m app train --help` prints `describe()`."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

# vLLM accepts only these LoRA ranks as `max_lora_rank` (vllm/config/lora.py MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

# grpo.loss: the policy losses train_loops/losses.py registers (it checks at import that its registry holds
# exactly these names), each with the line `train --help` shows.
POLICY_LOSSES = {
    "grpo": "PPO-clipped surrogate per token against the vLLM behaviour logprobs (clip_eps_low/high, "
            "tis_cap, loss_agg)",
    "dr_grpo": "Dr. GRPO: the grpo surrogate, advantages not divided by the group std, each sequence's token sum "
               "divided by the constant dr_grpo_norm_len (not by its length)",
    "gspo": "Qwen GSPO: sequence ratio exp(mean token log-ratio), clipped per sequence at "
            "gspo_clip_eps_low/high, token-level gradient (GSPO-token), mean over sequences",
    "cispo": "MiniMax-M1 CISPO: REINFORCE weighted by the detached clipped IS ratio "
             "clip(r, 1-cispo_eps_low, 1+cispo_eps_high); no token is dropped (loss_agg)",
    "dapo": "DAPO: the surrogate with clip-higher (dapo_clip_eps_low/high), token mean over the whole step; full "
            "DAPO adds dynamic_sampling=true and dapo_overlong_buffer > 0",
}
LOSS_NAMES = tuple(POLICY_LOSSES)
# grpo.loss_agg: how grpo and cispo reduce per-token losses over a step. The Literal is the one definition:
# the validator checks values against it (`_matches`), `train --help` prints it, the losses import LOSS_AGGS.
LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
LOSS_AGGS: tuple[str, ...] = typing.get_args(LossAgg)

# model.dtype; `auto` is resolved by `resolve_dtype` (the only place that decides it).
DType = Literal["auto", "float32", "bfloat16", "float16"]

# router.policy: prefix affinity or round robin (serve_deployments/request_router.RoutingPolicy), or Serve's own
# router. The one definition: the validator checks it, request_router imports ROUTING_POLICIES.
RouterPolicy = Literal["prefix", "round_robin", "serve_default"]
ROUTING_POLICIES: tuple[str, ...] = typing.get_args(RouterPolicy)


def resolve_dtype(dtype: str, use_gpu: bool) -> str:
    """The torch/vLLM dtype of `model.dtype`: `auto` is bfloat16 when training on GPUs (`train.use_gpu`), else
    float32. The trainer and the engines both use it, so behaviour and trainer logprobs are in one dtype."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if use_gpu else "float32"

# run.loggers -> (modules, any one of which will do; the pip extra that installs them). See app/loggers.py.
LOGGER_PACKAGES = {"jsonl": ((), ""), "tensorboard": (("tensorboard", "tensorboardX"), "tracking"),
                   "mlflow": (("mlflow",), "tracking"), "wandb": (("wandb",), "wandb")}


def _f(default, help: str, **kw):
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: json.loads(json.dumps(d)), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


@dataclass
class ModelConfig:
    path: str = _f("runs/tiny-model", "HF model directory (any causal LM vLLM and transformers load).")
    build_tiny: bool = _f(True, "Build the embedded tiny model at `path` if the directory does not exist.")
    tiny_seed: int = _f(0, "Seed of the embedded tiny model (weights are a pure function of it).")
    tiny_shape: str = _f("tiny", "Shape of the embedded model built at `path`: tiny | small | qwen2.5-1.5b "
                                 "(`python -m app tiny-model --help`).")
    dtype: DType = _f("auto", "Weights and compute dtype of trainer and engines; auto = bfloat16 when train.use_gpu, "
                              "else float32 (`resolve_dtype`).")
    max_model_len: int = _f(512, "Context length for the engines and the trainer (prompt + completion).")


@dataclass
class DataConfig:
    path: str = _f("builtin:letters", "Prompts: a .parquet or .jsonl file, a directory of split files or written by "
                                      "`datasets` save_to_disk (see `split`), or `builtin:letters` (toy task).")
    prompt_column: str = _f("prompt", "Column holding the prompt text.")
    answer_column: str = _f("answer", "Column holding the reference answer given to the reward.")
    id_column: str | None = _f(None, "Optional column with a stable prompt id (row index otherwise).")
    system_prompt: str | None = _f(None, "System message put before every prompt by the chat template.")
    use_chat_template: bool = _f(True, "Render prompts with the tokenizer's chat template.")
    shuffle_seed: int = _f(0, "Seed of the per-epoch shuffle.")
    epochs: int = _f(100, "Passes over the data (training stops at train.total_steps anyway).")
    builtin_size: int = _f(256, "Number of prompts the builtin task generates.")
    split: str = _f("train", "Split to read when `path` holds several: a `datasets` save_to_disk DatasetDict, or "
                             "a directory of SPLIT.parquet / SPLIT.jsonl / SPLIT-*.parquet files.")
    on_bad_row: str = _f("error", "A row with a missing/null column, a non-string or empty prompt or an empty answer: "
                                  "`error` refuses the data (naming row, column, problem), `skip` drops and counts it.")


@dataclass
class RewardConfig:
    fn: str = _f("app.rewards:letter_reward", "Reward function `module:function(completion, answer, prompt) -> float`; "
                                              "it also gets the data row (`row=`, every column) and vLLM's "
                                              "`finish_reason=` (stop | length) when it accepts those keywords.")
    where: str = _f("worker", "Run rewards in the rollout worker (`worker`) or as Ray tasks (`task`).")


@dataclass
class LoraConfig:
    rank: int = _f(8, "LoRA rank r.")
    alpha: float = _f(16.0, "LoRA alpha (scaling = alpha / rank).")
    dropout: float = _f(0.0, "LoRA dropout.")
    target_modules: Any = _f("all-linear", "Module names (list, e.g. [q_proj, v_proj]) or `all-linear`.")
    use_dora: bool = _f(False, "DoRA (vLLM cannot serve it: forces merge sync).")
    modules_to_save: list = _f([], "Extra trained full modules (vLLM cannot serve them: forces merge sync).")


@dataclass
class GRPOConfig:
    group_size: int = _f(8, "Completions sampled per prompt (G).")
    prompts_per_step: int = _f(8, "Prompts per optimizer step (batch = prompts_per_step x group_size).")
    lr: float = _f(1e-3, "AdamW learning rate over the LoRA parameters.")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    loss: str = _f("grpo", "Policy loss (train_loops/losses.py), one of:\n"
                   + "\n".join(f"      {k}: {v}" for k, v in POLICY_LOSSES.items()))
    clip_eps_low: float = _f(0.2, "PPO clip: ratio lower bound 1 - eps_low.")
    clip_eps_high: float = _f(0.2, "PPO clip: ratio upper bound 1 + eps_high (DAPO clip-higher when larger).")
    kl_coef: float = _f(0.0, "KL to the base policy (adapter disabled); 0 skips the reference forward.")
    tis_cap: float | None = _f(None, "Truncated importance sampling cap on trainer/behaviour ratio; null = off "
                                     "(losses grpo, dr_grpo, dapo).")
    scale_rewards: bool = _f(True, "Divide advantages by the group std (always off under loss dr_grpo).")
    loss_agg: LossAgg = _f("token-mean", "The reduction of losses grpo and cispo over a step (dr_grpo, gspo and dapo "
                                         "have their own).")
    gspo_clip_eps_low: float = _f(3e-4, "gspo: sequence ratio lower bound 1 - eps (GSPO's ranges are tiny).")
    gspo_clip_eps_high: float = _f(4e-4, "gspo: sequence ratio upper bound 1 + eps.")
    cispo_eps_low: float = _f(1.0, "cispo: IS weight lower bound 1 - eps (1.0 = none, as in MiniMax-M1).")
    cispo_eps_high: float = _f(0.28, "cispo: IS weight upper bound 1 + eps.")
    dapo_clip_eps_low: float = _f(0.2, "dapo: ratio lower bound 1 - eps.")
    dapo_clip_eps_high: float = _f(0.28, "dapo: ratio upper bound 1 + eps (clip-higher: > dapo_clip_eps_low).")
    dr_grpo_norm_len: int | None = _f(None, "dr_grpo: the constant each sequence's token sum is divided by; "
                                            "null = grpo.max_new_tokens.")
    dapo_overlong_buffer: int = _f(0, "Overlong reward shaping (any loss): completions longer than max_new_tokens "
                                      "- buffer get a penalty growing linearly to -dapo_overlong_penalty at "
                                      "max_new_tokens; 0 = off.")
    dapo_overlong_penalty: float = _f(1.0, "Overlong shaping: the penalty at max_new_tokens.")
    dynamic_sampling: bool = _f(False, "Drop groups whose rewards are all equal (no learning signal) and sample "
                                       "new ones in their place (DAPO); counted as filtered_groups.")
    temperature: float = _f(1.0, "Sampling temperature.")
    top_p: float = _f(1.0, "Sampling top-p.")
    ignore_eos: bool = _f(False, "Generate exactly max_new_tokens per completion (speed benchmarks; "
                                 "length-controlled runs).")
    max_new_tokens: int = _f(16, "Max completion tokens.")


@dataclass
class TrainConfig:
    num_workers: int = _f(2, "Ray Train workers (ranks).")
    cpus_per_worker: float = _f(0.5, "CPUs reserved per worker (fractions let training and serving share 2 cores).")
    use_gpu: bool = _f(False, "Train on GPUs (nccl, bf16 under dtype auto).")
    gpus_per_worker: float = _f(1.0, "GPUs reserved per worker when use_gpu; a fraction (e.g. 0.5) shares one GPU "
                                     "with a rollout replica (see recipes/gpu-1x.yaml).")
    zero_stage: int = _f(2, "DeepSpeed ZeRO stage 0-2 (3 is refused on GPU for LoRA: see the validation message).")
    max_tokens_per_micro_batch: int | None = _f(
        None, "Padded tokens (sequences x longest sequence) per micro-batch; a step's sequences are split by their "
              "real lengths, the loss stays exact for any split. null = automatic from the model's shape and free "
              "memory (GPU) or 16384 (CPU).")
    max_grad_norm: float = _f(1.0, "Gradient clipping (0 = off).")
    total_steps: int = _f(30, "Optimizer steps to run.")
    seed: int = _f(0, "Seed of LoRA init, sampling and shuffles.")
    gradient_checkpointing: bool = _f(False, "Recompute activations in backward (GPU, long sequences).")
    logprob_chunk: int = _f(4096, "Tokens per chunk when computing token logprobs (bounds the log-softmax memory).")
    liger_kernels: Literal["auto", "on", "off"] = _f(
        "auto", "Liger's fused RMSNorm / RoPE / SwiGLU kernels in the trainer (GPU; train_loops/fused_kernels.py): "
                "auto = when liger_kernel is installed and training runs on GPU.")
    fused_lora: bool = _f(True, "LoRA linears add their update inside the base layer's GEMM, scaling the rank-r "
                                "activation (train_loops/lora_linear.py): same math, less memory traffic; false = "
                                "PEFT's own layer.")


@dataclass
class RolloutConfig:
    replicas: int = _f(2, "vLLM replicas (Serve deployment replicas).")
    cpus_per_replica: float = _f(0.5, "CPUs reserved per replica.")
    gpus_per_replica: float = _f(0.0, "GPUs per replica (tensor_parallel of them on GPU).")
    tensor_parallel: int = _f(1, "vLLM tensor parallel size.")
    max_lora_rank: int = _f(8, "vLLM max_lora_rank; one of 1, 8, 16, 32, 64, 128, 256, 320, 512.")
    kv_cache_gib: int = _f(1, "VLLM_CPU_KVCACHE_SPACE on CPU (whole GiB: vLLM reads it as an integer).")
    gpu_memory_utilization: float = _f(0.85, "vLLM gpu_memory_utilization on GPU.")
    max_num_seqs: int = _f(64, "vLLM max_num_seqs.")
    enforce_eager: bool = _f(True, "Skip CUDA graphs / torch.compile (fast start); set False on GPU for speed.")
    workers: int = _f(2, "Rollout worker actors that turn prompts into scored groups.")
    groups_per_worker: int = _f(1, "Groups each rollout worker samples concurrently (workers x this = groups in "
                                   "flight; enough to fill the engines' batches on GPU).")
    http_port: int = _f(8000, "Serve HTTP port of the OpenAI-compatible router.")
    admin_token: str | None = _f(None, "Bearer token for admin routes; env LORA_GRPO_ADMIN_TOKEN if null; "
                                       "none = admin off.")
    app_name: str = _f("policy", "Serve application name.")
    max_body_bytes: int = _f(4 * 1024 * 1024, "Largest REST request body in bytes; a larger one is answered 413 "
                                              "without being parsed.")
    max_inflight_per_replica: int | None = _f(
        None, "REST + rollout requests in flight per replica (the router ingress admits at most this x replicas); "
              "a REST request over it is answered 429 with Retry-After. null = 4 x max_num_seqs.")


@dataclass
class RouterConfig:
    policy: RouterPolicy = _f("prefix", "prefix: longest prompt-specific prefix match with load balance; round_robin; "
                                        "serve_default: Serve's own router (no prefix routing).")
    imbalance: int = _f(8, "Spill to the least-loaded replica when the prefix owner has this many more in flight.")
    max_tracked_blocks: int = _f(100_000, "Per-replica LRU bound on tracked block hashes.")
    skip_generic: bool = _f(True, "prefix: match only past blocks that identify no prompt (held by every replica, "
                                  "or followed by 2+ different blocks); false = plain longest match from the start.")


@dataclass
class SyncConfig:
    mode: str = _f("adapter", "adapter | merge: publish LoRA tensors, or fold into base weights and push those.")
    every: int = _f(1, "Publish every N optimizer steps.")
    delta_threshold: float = _f(0.0, "Skip a publish when no adapter tensor moved more than this (max abs).")
    max_staleness: int = _f(2, "Accept samples of versions >= trainer version - max_staleness.")
    max_loras: int | None = _f(None, "Adapter slots per replica; default and minimum max_staleness + 2.")
    overlap_publish: bool = _f(True, "Async runs: hand the adapter to the registry in the background while the "
                                     "next step trains (a step costs max(learn, publish), not their sum); "
                                     "publishes stay in order, one in flight. Sync runs always wait.")


@dataclass
class CheckpointConfig:
    every: int = _f(10, "Checkpoint every N steps (0 = only at the end).")
    keep: int = _f(2, "Checkpoints Ray Train keeps.")
    resume_from: str | None = _f(None, "Checkpoint directory to resume from.")


@dataclass
class RunConfig:
    name: str = _f("grpo", "Run name (subdirectory of out_dir).")
    out_dir: str = _f("runs", "Where run directories go (metrics.jsonl, plots, adapter, checkpoints).")
    mode: str = _f("async", "async (rollouts run ahead) | sync (generate, then train, alternating).")
    serve_after: bool = _f(False, "Keep serving the final policy after training until interrupted.")
    ray_address: str | None = _f(None, "Ray address to join; null = the job's cluster or a new local one.")
    stall_timeout_s: float = _f(600.0, "Fail the run (exit non-zero, with the buffer, registry and replica state) "
                                       "when no step finished and nothing was generated for this long.")
    loggers: list = _f(["jsonl"], "Experiment trackers: any of jsonl, tensorboard, mlflow, wandb (jsonl = "
                                  "metrics.jsonl, always on; tensorboard -> RUN_DIR/tensorboard/; mlflow -> "
                                  "mlflow_tracking_uri; wandb offline in RUN_DIR/wandb/ unless WANDB_API_KEY is set). "
                                  "pip install -e '.[tracking]' (tensorboard, mlflow) or '.[wandb]'.")
    mlflow_tracking_uri: str | None = _f(None, "MLflow tracking URI (e.g. http://host:5000); null = the file store "
                                               "RUN_DIR/mlruns.")
    tracking_project: str = _f("lora-grpo", "MLflow experiment / W&B project the run is logged under.")
    log_every: int = _f(10, "Print one summary line (reward, eval, staleness, tokens/s, sync latency) every N steps "
                            "on the console; Ray, Serve, vLLM and DeepSpeed logs go to RUN_DIR/logs/ "
                            "(`train --verbose` streams them).")


@dataclass
class EvalConfig:
    path: str | None = _f(None, "Held-out prompts scored during training through the served policy: a file or "
                                "directory like data.path (same columns and reward), or `builtin:letters-heldout` "
                                "(letters prompts disjoint from `builtin:letters`); null = no evaluation.")
    every: int = _f(10, "Evaluate the version just published every N optimizer steps (also before step 1 and "
                        "after the last step); runs beside the rollouts, never stalls training.")
    samples: int = _f(64, "Eval prompts (the first N of eval.path).")
    pass_k: int = _f(1, "1 = pass@1, greedy (eval/accuracy); k > 1 also samples k completions per prompt at "
                        "grpo.temperature and reports eval/pass@k (any of the k correct).")


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

    # Derived values live here, computed from fields, never stored twice.
    @property
    def scale_advantages(self) -> bool:
        """Divide advantages by the group std: grpo.scale_rewards, never under Dr. GRPO."""
        return self.grpo.scale_rewards and self.grpo.loss != "dr_grpo"

    @property
    def max_loras(self) -> int:
        return self.sync.max_loras if self.sync.max_loras is not None else self.sync.max_staleness + 2

    @property
    def torch_dtype(self) -> str:
        return resolve_dtype(self.model.dtype, self.train.use_gpu)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.out_dir) / self.run.name

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class ConfigError(ValueError):
    """Every broken rule of a config, one line each, naming the key."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid config:\n" + "\n".join(f"  - {p}" for p in problems))


# ---------------------------------------------------------------- loading

def _section_types() -> dict[str, type]:
    return typing.get_type_hints(Config)


# Keys earlier versions had, and what replaced them.
_REMOVED = {"train.grad_accum": "removed: steps are cut into micro-batches by train.max_tokens_per_micro_batch"}


def from_dict(d: dict | None) -> Config:
    """Build a Config from nested dicts; unknown sections or keys are errors naming them."""
    d = d or {}
    problems, kwargs = [], {}
    types = _section_types()
    for sec, val in d.items():
        if sec not in types:
            problems.append(f"{sec}: unknown section (known: {', '.join(types)})")
            continue
        if val is None:
            continue
        if not isinstance(val, dict):
            problems.append(f"{sec}: must be a mapping, got {type(val).__name__}")
            continue
        cls = types[sec]
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = [k for k in val if k not in names]
        problems += [f"{sec}.{k}: unknown key" + (f" ({_REMOVED[f'{sec}.{k}']})" if f"{sec}.{k}" in _REMOVED else "")
                     for k in unknown]
        hints = typing.get_type_hints(cls)
        kwargs[sec] = cls(**{k: _literal_word(v, hints[k]) for k, v in val.items() if k in names})
    if problems:
        raise ConfigError(problems)
    return Config(**kwargs)


def _coerce(text: str) -> Any:
    """`--set` values are YAML scalars: 3, 0.5, 1e-4, true, null, [q_proj, v_proj], strings."""
    value = yaml.safe_load(text)
    if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    return value


def apply_overrides(d: dict, overrides: list[str]) -> dict:
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError([f"--set {item!r}: expected key=value (e.g. train.total_steps=10)"])
        key, _, value = item.partition("=")
        parts = key.strip().split(".")
        if len(parts) != 2:
            raise ConfigError([f"--set {key}: keys are section.name (e.g. grpo.lr)"])
        d.setdefault(parts[0], {})
        if not isinstance(d[parts[0]], dict):
            d[parts[0]] = {}
        d[parts[0]][parts[1]] = _coerce(value)
    return d


def load(path: str | None = None, overrides: list[str] | None = None) -> Config:
    """YAML file (optional) + overrides -> validated Config. Raises ConfigError."""
    d: dict = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError([f"config file {path}: not found"])
        try:
            d = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError([f"config file {path}: not valid YAML ({e})"]) from e
        if not isinstance(d, dict):
            raise ConfigError([f"config file {path}: top level must be a mapping of sections"])
    cfg = from_dict(apply_overrides(d, overrides or []))
    validate(cfg)
    return cfg


# ---------------------------------------------------------------- validation

def _literal_word(v, tp):
    """YAML 1.1 reads `off` / `on` as booleans (in files and in --set alike); a field whose allowed
    words include them gets the word back."""
    if isinstance(v, bool) and typing.get_origin(tp) is Literal and ("on" if v else "off") in typing.get_args(tp):
        return "on" if v else "off"
    return v


def _type_problems(cfg: Config) -> list[str]:
    """Check each field against its annotation (int, float, bool, str, optional, list)."""
    problems = []
    for sec_name, sec_type in _section_types().items():
        sec = getattr(cfg, sec_name)
        hints = typing.get_type_hints(sec_type)
        for f in dataclasses.fields(sec_type):
            v, tp = getattr(sec, f.name), hints[f.name]
            if not _matches(v, tp):
                problems.append(f"{sec_name}.{f.name}: expected {_tname(tp)}, got {v!r}")
    return problems


def _matches(v, tp) -> bool:
    if tp is Any:
        return True
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return isinstance(v, str | int) and not isinstance(v, bool) and v in args
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return any(_matches(v, a) for a in args)
    if tp is type(None):
        return v is None
    if tp is bool:
        return isinstance(v, bool)
    if tp is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if tp is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if tp in (list, dict, str):
        return isinstance(v, tp)
    if origin in (list, dict):
        return isinstance(v, origin)
    return isinstance(v, tp)


def _tname(tp) -> str:
    args = typing.get_args(tp)
    if typing.get_origin(tp) is Literal:
        return " | ".join(str(a) for a in args)
    if args:
        return " or ".join("null" if a is type(None) else getattr(a, "__name__", str(a)) for a in args)
    return getattr(tp, "__name__", str(tp))


def validate(cfg: Config) -> None:
    """Raise ConfigError listing every broken rule; checks that need no model files."""
    p = _type_problems(cfg)
    if p:  # later rules assume the types hold
        raise ConfigError(p)
    m, g, t, r, s, lo = cfg.model, cfg.grpo, cfg.train, cfg.rollout, cfg.sync, cfg.lora

    def need(ok: bool, msg: str):
        if not ok:
            p.append(msg)

    need(m.max_model_len >= 16, "model.max_model_len: must be >= 16")
    need(m.tiny_shape in ("tiny", "small", "qwen2.5-1.5b"),
         f"model.tiny_shape: {m.tiny_shape!r} is not tiny, small or qwen2.5-1.5b")
    need(cfg.data.epochs >= 1, "data.epochs: must be >= 1")
    need(cfg.data.builtin_size >= 1, "data.builtin_size: must be >= 1")
    need(cfg.data.on_bad_row in ("error", "skip"), f"data.on_bad_row: {cfg.data.on_bad_row!r} is not error or skip")
    need(bool(cfg.data.split) and "/" not in cfg.data.split, f"data.split: {cfg.data.split!r} is not a split name")
    need(":" in cfg.reward.fn, f"reward.fn: {cfg.reward.fn!r} is not `module:function`")
    need(cfg.reward.where in ("worker", "task"), f"reward.where: {cfg.reward.where!r} is not worker or task")
    need(lo.rank > 0, f"lora.rank: must be > 0, got {lo.rank}")
    need(lo.alpha > 0, f"lora.alpha: must be > 0, got {lo.alpha}")
    need(0.0 <= lo.dropout < 1.0, f"lora.dropout: must be in [0, 1), got {lo.dropout}")
    tm = lo.target_modules
    need(tm == "all-linear" or (isinstance(tm, list) and tm and all(isinstance(x, str) for x in tm)),
         f"lora.target_modules: must be `all-linear` or a non-empty list of module names, got {tm!r}")
    need(g.group_size >= 2,
         f"grpo.group_size: must be >= 2 (advantages are relative within a group), got {g.group_size}")
    need(g.prompts_per_step >= 1, "grpo.prompts_per_step: must be >= 1")
    need(g.lr > 0, "grpo.lr: must be > 0")
    need(g.clip_eps_low > 0 and g.clip_eps_high > 0, "grpo.clip_eps_low/high: must be > 0")
    need(g.clip_eps_low < 1, "grpo.clip_eps_low: must be < 1")
    need(g.kl_coef >= 0, "grpo.kl_coef: must be >= 0")
    need(g.tis_cap is None or g.tis_cap >= 1.0, f"grpo.tis_cap: must be null or >= 1, got {g.tis_cap}")
    need(g.loss in LOSS_NAMES, f"grpo.loss: {g.loss!r} is not one of {', '.join(LOSS_NAMES)}")
    need(g.tis_cap is None or g.loss in ("grpo", "dr_grpo", "dapo"),
         f"grpo.tis_cap: applies to losses grpo, dr_grpo and dapo; {g.loss} weights by the behaviour ratio itself")
    for k in ("gspo_clip_eps_low", "gspo_clip_eps_high", "dapo_clip_eps_low", "dapo_clip_eps_high", "cispo_eps_high"):
        need(getattr(g, k) > 0, f"grpo.{k}: must be > 0, got {getattr(g, k)}")
    need(g.gspo_clip_eps_low < 1 and g.dapo_clip_eps_low < 1, "grpo.gspo_clip_eps_low/dapo_clip_eps_low: must be < 1")
    need(0 < g.cispo_eps_low <= 1, f"grpo.cispo_eps_low: must be in (0, 1], got {g.cispo_eps_low}")
    need(g.dr_grpo_norm_len is None or g.dr_grpo_norm_len >= 1, "grpo.dr_grpo_norm_len: must be null or >= 1")
    need(0 <= g.dapo_overlong_buffer < g.max_new_tokens,
         f"grpo.dapo_overlong_buffer: must be in [0, max_new_tokens {g.max_new_tokens}), got {g.dapo_overlong_buffer}")
    need(g.dapo_overlong_penalty >= 0, "grpo.dapo_overlong_penalty: must be >= 0")
    need(g.temperature > 0, "grpo.temperature: must be > 0")
    need(0 < g.top_p <= 1, "grpo.top_p: must be in (0, 1]")
    need(1 <= g.max_new_tokens < m.max_model_len, "grpo.max_new_tokens: must be >= 1 and < model.max_model_len")
    need(t.num_workers >= 1, "train.num_workers: must be >= 1")
    need(t.cpus_per_worker > 0, "train.cpus_per_worker: must be > 0")
    need(0 <= t.zero_stage <= 3, f"train.zero_stage: must be 0, 1, 2 or 3, got {t.zero_stage}")
    need(t.max_tokens_per_micro_batch is None or t.max_tokens_per_micro_batch >= m.max_model_len,
         f"train.max_tokens_per_micro_batch: {t.max_tokens_per_micro_batch} is smaller than one sequence "
         f"(model.max_model_len {m.max_model_len}); raise it or lower max_model_len")
    need(not t.use_gpu or 0 < t.gpus_per_worker <= 1,
         f"train.gpus_per_worker: must be in (0, 1] (one worker uses at most one GPU), got {t.gpus_per_worker}")
    need(not (t.use_gpu and t.zero_stage == 3),
         "train.zero_stage: 3 is refused on GPU for LoRA. ZeRO-3 shards the frozen base weights and all-gathers "
         "every layer again in each forward and backward of every micro-batch (and the KL reference pass), "
         "to save optimizer state for a trainable part of a few MB; use zero_stage 2 (or 0), which keeps the "
         "base replicated and only reduces LoRA gradients")
    need(r.gpus_per_replica == 0 or t.use_gpu,
         "rollout.gpus_per_replica: set but train.use_gpu is false; GPU runs set both (a GPU engine with a CPU "
         "trainer would compute the behaviour and trainer logprobs on different hardware and dtypes)")
    need(r.gpus_per_replica >= 0, "rollout.gpus_per_replica: must be >= 0")
    need(t.liger_kernels != "on" or t.use_gpu,
         "train.liger_kernels: on needs train.use_gpu (Liger's kernels are Triton, GPU only); use auto or off")
    need(t.max_grad_norm >= 0, "train.max_grad_norm: must be >= 0")
    need(t.total_steps >= 1, "train.total_steps: must be >= 1")
    need(t.logprob_chunk >= 1, "train.logprob_chunk: must be >= 1")
    batch = g.prompts_per_step * g.group_size
    need(batch >= t.num_workers,
         f"grpo.prompts_per_step x grpo.group_size ({batch}) must be >= train.num_workers ({t.num_workers})")
    need(r.replicas >= 1, "rollout.replicas: must be >= 1")
    need(r.cpus_per_replica > 0, "rollout.cpus_per_replica: must be > 0")
    need(r.tensor_parallel >= 1, "rollout.tensor_parallel: must be >= 1")
    need(r.max_lora_rank in VLLM_LORA_RANKS,
         f"rollout.max_lora_rank: {r.max_lora_rank} is not one of {VLLM_LORA_RANKS}")
    need(r.kv_cache_gib >= 1, "rollout.kv_cache_gib: must be a whole number of GiB >= 1")
    need(0 < r.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization: must be in (0, 1]")
    need(r.workers >= 1, "rollout.workers: must be >= 1")
    need(r.groups_per_worker >= 1, "rollout.groups_per_worker: must be >= 1")
    need(1 <= r.http_port <= 65535, "rollout.http_port: must be a TCP port")
    need(r.max_body_bytes >= 1024, f"rollout.max_body_bytes: must be >= 1024, got {r.max_body_bytes}")
    need(r.max_inflight_per_replica is None or r.max_inflight_per_replica >= 1,
         f"rollout.max_inflight_per_replica: must be >= 1 or null, got {r.max_inflight_per_replica}")
    need(cfg.router.imbalance >= 1, "router.imbalance: must be >= 1")
    need(cfg.router.max_tracked_blocks >= 1, "router.max_tracked_blocks: must be >= 1")
    need(s.mode in ("adapter", "merge"), f"sync.mode: {s.mode!r} is not adapter or merge")
    need(s.every >= 1, "sync.every: must be >= 1")
    need(s.every - 1 <= s.max_staleness,
         f"sync.every: {s.every} publishes too rarely for sync.max_staleness {s.max_staleness}: samples of the "
         f"newest published version would already be stale; keep every <= max_staleness + 1")
    need(s.delta_threshold >= 0, "sync.delta_threshold: must be >= 0")
    need(s.max_staleness >= 0, "sync.max_staleness: must be >= 0")
    need(s.max_loras is None or s.max_loras >= s.max_staleness + 2,
         f"sync.max_loras: {s.max_loras} < sync.max_staleness + 2 ({s.max_staleness + 2}): live versions, "
         "their in-flight predecessors and a swap slot must fit")
    if s.mode == "adapter":
        need(lo.rank <= r.max_lora_rank,
             f"lora.rank: {lo.rank} exceeds rollout.max_lora_rank {r.max_lora_rank}; raise max_lora_rank or "
             "set sync.mode=merge")
    need(cfg.checkpoint.every >= 0, "checkpoint.every: must be >= 0")
    need(cfg.checkpoint.keep >= 1, "checkpoint.keep: must be >= 1")
    need(cfg.run.mode in ("async", "sync"), f"run.mode: {cfg.run.mode!r} is not async or sync")
    need(cfg.run.stall_timeout_s > 0, "run.stall_timeout_s: must be > 0")
    need(all(x in LOGGER_PACKAGES for x in cfg.run.loggers),
         f"run.loggers: {cfg.run.loggers!r} has unknown entries (known: {', '.join(LOGGER_PACKAGES)})")
    for name in cfg.run.loggers:
        mods, extra = LOGGER_PACKAGES.get(name, ((), ""))
        need(not mods or any(importlib.util.find_spec(m) is not None for m in mods),
             f"run.loggers: {name} needs the `{mods[0] if mods else name}` package, which is not installed: "
             f"pip install -e '.[{extra}]' (or pip install {mods[0] if mods else name})")
    need(bool(cfg.run.tracking_project), "run.tracking_project: must be a non-empty name")
    need(cfg.run.log_every >= 1, f"run.log_every: must be >= 1, got {cfg.run.log_every}")
    need(cfg.eval.every >= 1, f"eval.every: must be >= 1, got {cfg.eval.every}")
    need(cfg.eval.samples >= 1, f"eval.samples: must be >= 1, got {cfg.eval.samples}")
    need(cfg.eval.pass_k >= 1, f"eval.pass_k: must be >= 1, got {cfg.eval.pass_k}")
    need(cfg.eval.path is None or bool(cfg.eval.path.strip()), "eval.path: must be null or a path")
    need(cfg.eval.path != "builtin:letters-heldout" or cfg.data.builtin_size <= 4096,
         f"eval.path: builtin:letters-heldout is disjoint from the first 4096 builtin:letters prompts only; "
         f"data.builtin_size is {cfg.data.builtin_size}")
    need(bool(cfg.run.name) and "/" not in cfg.run.name, "run.name: must be a non-empty name without '/'")
    if p:
        raise ConfigError(p)


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
    for sec_name, sec_type in _section_types().items():
        lines.append(f"{sec_name}:")
        hints = typing.get_type_hints(sec_type)
        for f in dataclasses.fields(sec_type):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"  {sec_name}.{f.name} ({_tname(hints[f.name])}, default {default!r}): "
                         f"{f.metadata.get('help', '')}")
    return "\n".join(lines)
