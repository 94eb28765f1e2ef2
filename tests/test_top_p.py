"""Top-p fidelity: the trainer's token logprobs are taken under the nucleus vLLM sampled from.

- Pure torch: train_loops/head_logprobs.py's nucleus against a direct float64 implementation of the rule
  and against vLLM's own top-p function (installed source), on all three head paths (fused autograd
  function, checkpointed, no-grad), values, entropy and gradients; top_p=1 is the plain log-softmax; a
  target outside the nucleus and ties cut at the boundary.
- The real thing: one CPU vLLM replica (the project's engine config and replica) samples at top_p 1.0 and
  0.9; the trainer's logprobs of those tokens (sequence_logprobs) match the engine's as closely at 0.9 as
  at 1.0, while the full-softmax computation (what the trainer did before) is clearly off at 0.9.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from tests._serve_helpers import deploy_replicas, prompt_ids, retire_all, serve_env, small_config  # noqa: F401
from train_loops import head_logprobs as hl
from train_loops.grpo import chunked_token_logprobs, sequence_logprobs

V, H, N = 97, 16, 41


def reference_nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """[N, V] bool: per row, sort probabilities descending and keep the smallest prefix whose mass is
    >= top_p (the top token always). A token is dropped once the mass before it is >= top_p, i.e. once
    its own mass and all below it is <= 1 - top_p: checked that way, with exact sums (math.fsum) of
    unnormalised float64 probabilities, rounding cannot drop a token at top_p=1."""
    weights = torch.exp(logits.double() - logits.double().amax(-1, keepdim=True))
    keep = torch.zeros_like(weights, dtype=torch.bool)
    for r in range(weights.shape[0]):
        w = weights[r].tolist()
        order = sorted(range(len(w)), key=lambda j: -w[j])
        total = math.fsum(w)
        for n, j in enumerate(order):
            if n and math.fsum(w[k] for k in order[n:]) <= (1 - top_p) * total:
                break
            keep[r, j] = True
    return keep


def vllm_logprobs(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """What vLLM returns as `processed_logprobs` at this top_p (its CPU/PyTorch top-p, installed source)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    p = torch.full((logits.shape[0],), top_p, dtype=torch.float32)
    return torch.log_softmax(apply_top_k_top_p_pytorch(logits.float().clone(), None, p), -1)


def _three_paths(h, y, weight, temperature, top_p):
    """(logp, entropy, grad wrt h) through the fused function, the checkpointed path and no-grad."""
    upstream = torch.linspace(-1.0, 2.0, h.shape[0])  # an arbitrary incoming gradient
    frozen = torch.nn.Linear(H, V, bias=False).requires_grad_(False)
    trainable = torch.nn.Linear(H, V, bias=False)  # a head with grad: the checkpointed path
    with torch.no_grad():
        frozen.weight.copy_(weight)
        trainable.weight.copy_(weight)
    out = []
    for head in (frozen, trainable):
        hh = h.clone().requires_grad_(True)
        lp, ent = chunked_token_logprobs(hh, y, head, chunk=7, temperature=temperature, top_p=top_p)
        (lp * upstream).sum().backward()
        out.append((lp.detach(), ent, hh.grad))
    with torch.no_grad():
        lp, ent = chunked_token_logprobs(h, y, frozen, chunk=7, temperature=temperature, top_p=top_p)
    out.append((lp, ent, None))
    return out, upstream


@pytest.mark.parametrize("top_p", [1.0, 0.95, 0.7, 0.3, 1e-3])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_truncated_logprobs_match_the_rule_and_vllm(top_p, temperature, monkeypatch):
    monkeypatch.setattr(hl, "_SORT_ELEMENTS", 3 * V)  # the sort runs 3 rows at a time: slices are covered
    torch.manual_seed(0)
    weight, h = torch.randn(V, H) * 0.6, torch.randn(N, H) * 2.0
    logits = (h @ weight.t()) / temperature
    keep = reference_nucleus(logits, top_p)
    vllm = vllm_logprobs(logits, top_p)
    assert torch.equal(keep, vllm > -math.inf)  # the rule as written is vLLM's rule
    if top_p == 1.0:
        assert keep.all()
    if top_p == 1e-3:
        assert (keep.sum(-1) == 1).all()
    y = torch.multinomial(keep.double(), 1, generator=torch.Generator().manual_seed(1)).squeeze(1)  # in-nucleus

    # reference in float64: log-softmax over the kept tokens only, the nucleus held fixed
    h64 = h.double().requires_grad_(True)
    ref_all = torch.log_softmax((h64 @ weight.double().t() / temperature).masked_fill(~keep, -math.inf), -1)
    ref = ref_all.gather(1, y[:, None]).squeeze(1)
    q = ref_all.detach().exp()
    ref_ent = -torch.where(keep, q * ref_all.detach(), 0.0).sum(-1)
    paths, upstream = _three_paths(h, y, weight, temperature, top_p)
    (ref * upstream.double()).sum().backward()
    for lp, ent, grad in paths:
        assert torch.allclose(lp.double(), ref.detach(), atol=2e-5)
        assert torch.allclose(lp, vllm.gather(1, y[:, None]).squeeze(1), atol=2e-6)
        assert torch.allclose(ent.double(), ref_ent, atol=2e-5)
        if grad is not None:
            assert torch.allclose(grad.double(), h64.grad, atol=2e-5)
    if top_p == 1.0:  # identical to the plain log-softmax
        full = torch.log_softmax(logits, -1).gather(1, y[:, None]).squeeze(1)
        assert torch.allclose(paths[0][0], full, atol=1e-6) and torch.allclose(paths[2][0], full, atol=1e-6)


def test_a_target_outside_the_nucleus_counts_as_inside():
    """The engine only samples nucleus tokens, but the trainer's logits can put a sampled token just
    outside its own nucleus: it is then added to it (finite logp, finite ratio and KL), not -inf."""
    logits = torch.tensor([[4.0, 2.0, 1.0, 0.0, -1.0]])
    top_p = 0.5  # keeps token 0 alone (mass 0.83)
    assert reference_nucleus(logits, top_p).tolist() == [[True, False, False, False, False]]
    weight = torch.eye(5)  # logits = hidden, exactly
    for head_grad in (False, True):
        head = torch.nn.Linear(5, 5, bias=False).requires_grad_(head_grad)
        with torch.no_grad():
            head.weight.copy_(weight)
        h = logits.clone().requires_grad_(True)
        lp, ent = chunked_token_logprobs(h, torch.tensor([2]), head, chunk=4, top_p=top_p)
        want = 1.0 - math.log(math.exp(4.0) + math.exp(1.0))  # over {0, 2}
        assert lp.item() == pytest.approx(want, abs=1e-6)
        q = torch.tensor([math.exp(4.0), math.exp(1.0)])
        q = q / q.sum()
        assert ent.item() == pytest.approx(float(-(q * q.log()).sum()), abs=1e-6)
        lp.sum().backward()
        # d logp(2) / d logits = onehot(2) - q over {0, 2}; zero on the dropped tokens
        want_grad = torch.tensor([[-q[0], 0.0, 1 - q[1], 0.0, 0.0]])
        assert torch.allclose(h.grad, want_grad, atol=1e-6)
    # without the rule the truncated logp would be -inf; the old full softmax is finite but off
    assert lp.item() > torch.log_softmax(logits, -1)[0, 2].item()


@pytest.mark.parametrize("target, other_tied_weight", [(0, 2 / 4), (2, 1 / 3)])
def test_ties_cut_at_the_boundary(target, other_tied_weight):
    """Four tokens tied at the nucleus boundary, two of them kept: the normaliser counts exactly two
    (whichever two vLLM kept); the gradient spreads the kept count evenly over the tied tokens, the
    target (sampled, so kept) at full weight."""
    a, b, c = math.exp(3.0), math.exp(1.0), math.exp(-1.0)
    row = [3.0] + [1.0] * 4 + [-1.0] * 7
    z_full = a + 4 * b + 7 * c
    top_p = 1 - (7 * c + 2.5 * b) / z_full  # drops the 7 low tokens and 2 of the 4 tied ones
    logits = torch.tensor([row])
    vllm = vllm_logprobs(logits, top_p)
    assert int((vllm[0, 1:5] > -math.inf).sum()) == 2 and vllm[0, 0] > -math.inf
    logz = math.log(a + 2 * b)
    assert vllm[0, 0].item() == pytest.approx(3.0 - logz, abs=1e-6)
    tau, tie_w, z, _ = hl.nucleus(logits, torch.tensor([target]), top_p)
    assert (tau.item(), z.item()) == (pytest.approx(1.0), pytest.approx(logz, abs=1e-6))
    assert tie_w.item() == pytest.approx(other_tied_weight)
    want_grad = -torch.tensor([a] + [b * other_tied_weight] * 4 + [0.0] * 7) / (a + 2 * b)
    want_grad[target] = 1 - (a if target == 0 else b) / (a + 2 * b)
    for head_grad in (False, True):  # fused and checkpointed
        head = torch.nn.Linear(12, 12, bias=False).requires_grad_(head_grad)
        with torch.no_grad():
            head.weight.copy_(torch.eye(12))
        h = logits.clone().requires_grad_(True)
        lp, _ = chunked_token_logprobs(h, torch.tensor([target]), head, chunk=4, top_p=top_p)
        assert lp.item() == pytest.approx(row[target] - logz, abs=1e-6)
        lp.sum().backward()
        assert torch.allclose(h.grad[0], want_grad.float(), atol=1e-6)
        assert abs(float(h.grad.sum())) < 1e-6  # a softmax over the kept set: it sums to one


# ------------------------------------------------------------------------------------------ real vLLM

APP = "top-p-test"
TOP_PS = (1.0, 0.9)
PROMPTS = ["say something", "what is two plus two?", "name three colours", "hello there"]


@pytest.fixture(scope="module")
def rollouts(serve_env):
    """One replica (one engine start), 4 prompts x 4 samples x 40 tokens at each top_p, temperature 1."""
    from ray import serve

    retire_all(serve_env.registry)
    handle = deploy_replicas(small_config(serve_env.model_dir, replicas=1), APP)
    try:
        out = {}
        for top_p in TOP_PS:
            sampling = {"max_tokens": 40, "temperature": 1.0, "top_p": top_p, "logprobs": True, "ignore_eos": True}
            reqs = [handle.generate.remote({"prompt_token_ids": prompt_ids(serve_env.model_dir, text), "version": 0,
                                            "sampling": sampling}) for text in PROMPTS for _ in range(4)]
            out[top_p] = [r.result(timeout_s=300) for r in reqs]
        yield out
    finally:
        serve.delete(APP)


@pytest.mark.slow
def test_trainer_logprobs_match_vllm_under_top_p(serve_env, rollouts):
    from common.types import Sample
    from tests._serve_helpers import _base_model
    from train_loops.batches import collate

    model = _base_model(serve_env.model_dir)

    def mean_abs_log_ratio(outs, top_p):
        b = collate([Sample(o["prompt_token_ids"], o["token_ids"], o["logprobs"], 0.0, 0.0, 0) for o in outs])
        with torch.no_grad():
            logp, _ = sequence_logprobs(model, b["input_ids"], b["attention_mask"], b["pred_pos"], b["targets"],
                                        b["mask"], chunk=64, top_p=top_p)
        return float(((logp - b["behaviour_logp"]).abs() * b["mask"]).sum() / b["mask"].sum())

    base = mean_abs_log_ratio(rollouts[1.0], 1.0)
    fixed = mean_abs_log_ratio(rollouts[0.9], 0.9)
    old = mean_abs_log_ratio(rollouts[0.9], 1.0)  # the full softmax: what the trainer computed before
    print(json.dumps({"mean_abs_log_ratio": {"top_p_1.0": base, "top_p_0.9": fixed, "top_p_0.9_full_softmax": old}}))
    assert base < 1e-5  # CPU fp32: the engines agree to float rounding
    assert fixed < 1e-5 and fixed <= max(2 * base, 1e-6)
    assert old > 1e-2 and old > 100 * fixed  # the test can fail: vLLM's logprobs are the truncated ones
