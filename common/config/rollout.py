"""Sections rollout and router: the vLLM replicas, the rollout workers, the REST front, and how requests are
routed among the replicas."""
from __future__ import annotations

from common.config.base import Section, broken, option
from common.config.choices import BehaviourLogprobs, LoraRank, PartialPolicy, ProxyLocation, RouterPolicy, words


class RolloutConfig(Section):
    section = "rollout"
    replicas: int = option(2, "vLLM replicas (Serve deployment replicas).", ge=1)
    cpus_per_replica: float = option(0.5, "CPUs reserved per replica.", gt=0)
    gpus_per_replica: float = option(0.0, "GPUs per replica (tensor_parallel of them on GPU).", ge=0)
    tensor_parallel: int = option(1, "vLLM tensor parallel size.", ge=1)
    max_lora_rank: LoraRank = option(8, f"vLLM max_lora_rank; one of {words(LoraRank, ', ')}.")
    kv_cache_gib: int = option(1, "VLLM_CPU_KVCACHE_SPACE on CPU (whole GiB: vLLM reads it as an integer).", ge=1)
    gpu_memory_utilization: float = option(0.85, "vLLM gpu_memory_utilization on GPU.", gt=0, le=1)
    max_num_seqs: int = option(64, "vLLM max_num_seqs.", ge=1)
    enforce_eager: bool = option(True, "Skip CUDA graphs / torch.compile (fast start); set False on GPU for speed.")
    cudagraph_capture_sizes: list[int] | None = option(
        None, "GPU with enforce_eager false: the batch sizes vLLM captures CUDA graphs for at start-up (a batch runs "
              "padded to the next one; past the largest, without a graph). null = vLLM's own, ~50 sizes up to 512: "
              "fewer start faster.")
    cudagraph_specialize_lora: bool = option(
        True, "GPU with enforce_eager false: vLLM captures each graph twice, with and without an active adapter "
              "(its compilation_config.cudagraph_specialize_lora). A rollout samples under an adapter from version "
              "1 on; false halves the capture, and requests of the base model (version 0, a judge, REST) run the "
              "adapter kernels with none active.")
    workers: int = option(2, "Rollout worker actors that turn prompts into scored groups.", ge=1)
    max_restarts: int = option(
        3, "Restarts of one rollout worker in a row (Ray restarts a killed one; it gives its slots back) with no step "
           "logged between them before the run fails with one line. A logged step refills the budget, as for "
           "train.max_restarts.", ge=0)
    groups_per_worker: int = option(1, "Groups each rollout worker samples concurrently (workers x this = groups in "
                                       "flight; enough to fill the engines' batches on GPU).", ge=1)
    partial: bool = option(
        False, "Partial rollouts (async runs, sync.mode adapter): a sample in flight when a newer version goes live "
               "moves to it mid-completion (the engine request is aborted and continued from prompt + the tokens so "
               "far, token-exact, on the same replica) instead of finishing under an old version or being dropped "
               "as too stale; each token keeps its version and behaviour logprob, and sync.max_staleness judges a "
               "group by the version it finished under (docs/ARCHITECTURE.md, \"Partial rollouts\").")
    partial_policy: PartialPolicy = option(
        "at_limit", "With rollout.partial: at_limit moves a sample once its version is sync.max_staleness behind "
                    "the newest loaded (finished under it, it would miss the batch the trainer takes as it publishes "
                    "and be too stale for the next); all moves every sample under an older version as soon as a newer "
                    "one is loaded.")
    behaviour_logprobs: BehaviourLogprobs = option(
        "engine", "Who computes each sampled token's behaviour logprob: engine (vLLM returns it with the token) or "
                  "trainer (the engine samples without logprobs, ~25% of a GPU decode step, and the trainer scores "
                  "each sample under the adapter version that sampled it: the training forward itself for the "
                  "current version, one no-grad forward under a kept copy of an older version's LoRA weights "
                  "otherwise; train_loops/behaviour.py).")
    engine_logprobs_every: int = option(
        16, "rollout.behaviour_logprobs trainer: every Nth group of each rollout worker still asks the engine for "
            "logprobs (and keeps them for the loss), so the trainer/vLLM agreement (log_ratio_fresh) is still "
            "reported; 0 = never.", ge=0)
    http_port: int = option(8000, "Serve HTTP port of the OpenAI-compatible ingress.", ge=1, le=65535)
    proxy_location: ProxyLocation = option(
        "EveryNode", "Where Serve runs its HTTP proxies: EveryNode (each node answers on http_port), HeadOnly "
                     "(one proxy; also for several nodes on one machine, which would all bind the same port) "
                     "or Disabled (rollouts only, through handles).")
    admin_token: str | None = option(None, "Bearer token for admin routes; env LORA_GRPO_ADMIN_TOKEN if null; "
                                           "none = admin off.")
    app_name: str = option("policy", "Serve application name.")
    max_body_bytes: int = option(4 * 1024 * 1024, "Largest REST request body in bytes; a larger one is answered 413 "
                                                  "without being parsed.", ge=1024)
    max_inflight_per_replica: int | None = option(
        None, "REST + rollout requests in flight per replica (the ingress admits at most this x replicas); "
              "a REST request over it is answered 429 with Retry-After. null = 4 x max_num_seqs.", ge=1)
    stream_interval_ms: float = option(
        50.0, "REST streams: after the first token (sent at once), the tokens that arrive within this many ms travel "
              "as one message through the replica -> ingress -> proxy hops (0 = one message per token, as vLLM's "
              "own server writes them). Ray Serve LLM batches the same way (50 ms).", ge=0, le=1000)
    replica_http_port: int | None = option(
        0, "Also serve the OpenAI routes on each replica's own HTTP port, in the engine's process: this port, or "
           "the next free one for a second replica of the node (0: any free port; null: off, and so the REST front). "
           "No routing and no Serve hops: a client of one replica's port gets that replica at the speed of vLLM's own "
           "server. The URLs are in the service's stats (`replicas[].http_url`) and printed by `app serve`.",
        ge=0, le=65535)
    front_port: int | None = option(
        0, "The REST front, on by default: HAProxy on this port (0: any free one; null: off) sends the generation "
           "routes straight to a replica's own port (rollout.replica_http_port), chosen by a consistent hash of the "
           "model and the prompt's head with bounded load, and every other route to Serve's http_port: 0.91-1.00x "
           "vLLM's own server where Serve's port gives 0.5-0.6x (BENCHMARKS.md section 12). `app serve` prints its "
           "URL as the endpoint; where it cannot start (no HAProxy, the port taken, replica ports off) the service "
           "says why in one line and serves on http_port alone (serve_deployments/haproxy_front.py). A fleet has "
           "none.", ge=0, le=65535)
    tool_parser: str | None = option(
        "hermes", "vLLM tool parser for REST chat completions with `tools` and tool_choice auto (a name vLLM's "
                  "ToolParserManager knows: hermes for the Qwen/Hermes <tool_call> format); it also reads back "
                  "named and `required` tool choices. null = tool calling off (only tool_choice none).")

    def problems(self) -> list[str]:
        # Only a port asked for by number is held to these; the default (0) falls back to http_port with a line.
        asked = self.front_port not in (None, 0)
        sizes = self.cudagraph_capture_sizes
        return broken(
            (sizes is None or (len(sizes) > 0 and all(n >= 1 for n in sizes)),
             f"rollout.cudagraph_capture_sizes: batch sizes >= 1, at least one (null: vLLM's own), got {sizes}"),
            (not asked or self.replica_http_port is not None,
             "rollout.front_port: the front forwards to the replicas' own ports; set rollout.replica_http_port "
             "(0: any free port)"),
            (not asked or self.front_port != self.http_port,
             f"rollout.front_port: {self.front_port} is Serve's rollout.http_port; the front needs its own port"),
            (not asked or self.proxy_location != "Disabled",
             "rollout.front_port: the front sends every route but generation to Serve's proxy; "
             "rollout.proxy_location must not be Disabled"),
        )


class RouterConfig(Section):
    section = "router"
    policy: RouterPolicy = option(
        "prefix", "prefix: longest prompt-specific prefix match with load balance; round_robin; "
                  "serve_default: Serve's own router (no prefix routing).")
    imbalance: int = option(8, "Spill to the least-loaded replica when the prefix owner has this many more in "
                               "flight.", ge=1)
    max_tracked_blocks: int = option(100_000, "Per-replica LRU bound on tracked block hashes.", ge=1)
    skip_generic: bool = option(
        True, "prefix: match only past blocks that identify no prompt (held by every replica, "
              "or followed by 2+ different blocks); false = plain longest match from the start.")
