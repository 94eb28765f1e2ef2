"""The replica's vLLM pieces: the AsyncLLM engine and vLLM's OpenAI serving classes over it.

The one place a replica's vLLM engine is built. The replica takes both builders injected (replica.py's
`engine_factory`, `serving_factory`), so the rest of it runs against tests/support/fake_engine.py without
vLLM. What the replica uses of an engine: async `generate` (an async generator of RequestOutputs; closing
it aborts the request), `add_lora`, `remove_lora`, `collective_rpc`, `reset_prefix_cache`,
`pause_generation`, `resume_generation`, `check_health`, `shutdown`, `tokenizer.decode`,
`vllm_config.cache_config.block_size` and `model_config.max_model_len`.
"""
from __future__ import annotations

import importlib
import zlib
from collections.abc import Callable
from pathlib import Path

from common.names import BASE_NAME


class PrefixCacheCounter:
    """vLLM's own prefix-cache counters (the ones behind `vllm:prefix_cache_hits/queries`), summed
    from the scheduler stats the engine reports; one per replica process."""

    def __init__(self):
        self.hits = 0
        self.queries = 0

    def factory(self, vllm_config, engine_index: int = 0):
        from vllm.v1.metrics.loggers import StatLoggerBase

        counter = self

        class Logger(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
                if scheduler_stats is not None:
                    counter.hits += scheduler_stats.prefix_cache_stats.hits
                    counter.queries += scheduler_stats.prefix_cache_stats.queries

            def log_engine_initialized(self):
                pass

        return Logger(vllm_config, engine_index)


def replica_seed(seed, replica_id: str) -> int:
    """Replicas are built from identical args; with one seed they would draw identical random streams, so
    the k-th request on every replica would sample the same tokens (duplicate GRPO samples)."""
    return (int(seed or 0) * 1_000_003 + zlib.crc32(replica_id.encode())) % (2 ** 31)


_REAPERS: list = []  # held so that a running reaper's Popen is never collected (and warned about)


def build_engine(engine: dict, replica_id: str, prefix: PrefixCacheCounter):
    """vLLM's AsyncLLM from the engine kwargs (engine_config.engine_kwargs), seeded per replica, its
    prefix-cache stats counted into `prefix`."""
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from serve_deployments import engine_reaper

    engine = dict(engine, seed=replica_seed(engine.get("seed"), replica_id))
    before = engine_reaper.children()
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine), stat_loggers=[prefix.factory])
    # The engine core's process outlives a replica process that is killed; the reaper ends it then.
    reaper = engine_reaper.watch(before)
    if reaper is not None:
        _REAPERS.append(reaper)
    return llm


class VllmServing:
    """vLLM's own OpenAI serving classes over one engine: schema, validation, logprobs, SSE, and tool calling
    (`rollout.tool_parser`: vLLM's auto tool choice with that parser; None: off, and vLLM then refuses every
    tool_choice but "none"). `lora_requests` is vLLM's model registry of served adapters (name -> LoRA
    request): the adapter transport writes it, the serving classes look names up in it."""

    def __init__(self, engine, model: str, tool_parser: str | None = None):
        # Imported here, not at module level: they pull in FastAPI and the tokenizer stack.
        from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
        from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
        from vllm.entrypoints.openai.models.protocol import BaseModelPath
        from vllm.entrypoints.openai.models.serving import OpenAIServingModels
        from vllm.renderers.online_renderer import OnlineRenderer

        from serve_deployments.tool_parsers import tool_parser_error, tool_serving_kwargs

        names = [BASE_NAME] + ([Path(model).name] if Path(model).name != BASE_NAME else [])
        self._models = OpenAIServingModels(engine, [BaseModelPath(name=n, model_path=model) for n in names])
        tools = tool_serving_kwargs(tool_parser)
        try:  # vLLM tries the parser on the tokenizer here: a parser the model cannot use fails at start
            renderer = OnlineRenderer(model_config=engine.model_config, renderer=engine.renderer,
                                      request_logger=None, chat_template=None, chat_template_content_format="auto",
                                      **tools)
            self._chat = OpenAIServingChat(engine, self._models, "assistant", online_renderer=renderer,
                                           request_logger=None, chat_template=None,
                                           chat_template_content_format="auto", **tools)
        except Exception as e:
            if not tools:
                raise
            raise ValueError(tool_parser_error(tool_parser, e)) from e
        self._completion = OpenAIServingCompletion(engine, self._models, online_renderer=renderer,
                                                   request_logger=None)

    @property
    def lora_requests(self) -> dict:
        return self._models.lora_requests

    async def create_completion(self, request):
        return await self._completion.create_completion(request)

    async def create_chat_completion(self, request):
        return await self._chat.create_chat_completion(request)


def resolve(factory: str | Callable | None, default: Callable) -> Callable:
    """A factory given as a callable, as `"module:name"` (what survives Serve's bind arguments best), or
    None for `default`."""
    if factory is None:
        return default
    if callable(factory):
        return factory
    module, sep, name = str(factory).partition(":")
    if not sep or not module or not name:
        raise ValueError(f"factory {factory!r}: expected a callable or 'module:name'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"factory {factory!r} cannot be imported: {e}") from e
