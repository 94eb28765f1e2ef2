"""GRPO math against hand computation on small tensors."""
import math
import sys
from pathlib import Path

import pytest
import torch

from train_loops.grpo import (
    chunked_token_logprobs,
    group_advantages,
    grpo_loss,
    reference_logits_logprobs,
    sequence_logprobs,
)

sys.path.insert(0, str(Path(__file__).parent))

# Two sequences of uneven length: the second has a padded last position (its values must not matter).
LOGP = [[-1.0, -2.0, -0.5], [-1.5, -0.3, -9.0]]
BEH = [[-1.2, -1.5, -0.5], [-1.0, -0.6, -1.0]]
REF = [[-1.1, -1.8, -0.7], [-1.4, -0.5, -3.0]]
MASK = [[1, 1, 1], [1, 1, 0]]
ADV = [1.0, -0.5]
LO, HI = 0.2, 0.3


def t(x, **kw):
    return torch.tensor(x, dtype=torch.float64, **kw)


def hand_token_losses(kl_coef=0.0, tis_cap=None):
    """Per-token loss written out scalar by scalar."""
    out = []
    for b in range(2):
        row = []
        for j in range(3):
            if not MASK[b][j]:
                row.append(None)
                continue
            a = ADV[b]
            if tis_cap is None:
                r = math.exp(LOGP[b][j] - BEH[b][j])
                c = min(max(r, 1 - LO), 1 + HI)
                loss = -min(r * a, c * a)
            else:
                w = min(math.exp(LOGP[b][j] - BEH[b][j]), tis_cap)
                loss = -w * a  # ratio to the detached self is exactly 1, inside the clip range
            d = REF[b][j] - LOGP[b][j]
            loss += kl_coef * (math.exp(d) - d - 1)
            row.append(loss)
        out.append(row)
    return out


def hand_agg(tok, agg):
    flat = [x for row in tok for x in row if x is not None]
    if agg == "token-mean":
        return sum(flat) / len(flat)
    seqs = [[x for x in row if x is not None] for row in tok]
    if agg == "seq-mean-token-mean":
        return sum(sum(s) / len(s) for s in seqs) / len(seqs)
    return sum(sum(s) for s in seqs) / len(seqs)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("kl_coef,tis_cap", [(0.0, None), (0.1, None), (0.0, 1.5), (0.05, 1.2)])
def test_loss_matches_hand_computation(agg, kl_coef, tis_cap):
    loss, stats = grpo_loss(t(LOGP), t(BEH), torch.tensor(MASK), t(ADV), clip_eps_low=LO, clip_eps_high=HI,
                            loss_agg=agg, kl_coef=kl_coef, ref_logp=t(REF) if kl_coef else None, tis_cap=tis_cap)
    assert loss.item() == pytest.approx(hand_agg(hand_token_losses(kl_coef, tis_cap), agg), rel=1e-12)
    if kl_coef:
        kls = [math.exp(REF[b][j] - LOGP[b][j]) - (REF[b][j] - LOGP[b][j]) - 1
               for b in range(2) for j in range(3) if MASK[b][j]]
        assert stats["kl"] == pytest.approx(sum(kls) / 5)


def test_clip_stats_and_log_ratio():
    _, stats = grpo_loss(t(LOGP), t(BEH), torch.tensor(MASK), t(ADV), clip_eps_low=LO, clip_eps_high=HI)
    # ratios: e^.2 (A>0, inside), e^-.5 (A>0: lower clip never binds for A>0), 1, e^-.5 (A<0: 0.61 < 0.8 clips),
    # e^.3 (A<0: upper bound does not bind) -> one clipped token of five.
    assert stats["clip_frac"] == pytest.approx(1 / 5)
    lr = [0.2, 0.5, 0.0, 0.5, 0.3]
    assert stats["log_ratio_abs_mean"] == pytest.approx(sum(lr) / 5)
    assert stats["log_ratio_abs_max"] == pytest.approx(0.5)
    assert stats["tokens"] == 5


def test_clipped_tokens_get_no_gradient_and_padding_is_ignored():
    logp = t(LOGP, requires_grad=True)
    loss, _ = grpo_loss(logp, t(BEH), torch.tensor(MASK), t(ADV), clip_eps_low=LO, clip_eps_high=HI)
    loss.backward()
    g = logp.grad
    assert g[1, 0] == 0.0  # clipped (ratio 0.61 < 0.8 with A < 0)
    assert g[1, 2] == 0.0  # padding
    # unclipped token: d/dlogp of -r*A/N = -r*A/N
    assert g[0, 0].item() == pytest.approx(-math.exp(0.2) * 1.0 / 5)


def test_tis_gradient_is_truncated_weight_times_advantage():
    logp = t(LOGP, requires_grad=True)
    loss, stats = grpo_loss(logp, t(BEH), torch.tensor(MASK), t(ADV), clip_eps_low=LO, clip_eps_high=HI,
                            tis_cap=1.1)
    loss.backward()
    for b, j in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        w = min(math.exp(LOGP[b][j] - BEH[b][j]), 1.1)
        assert logp.grad[b, j].item() == pytest.approx(-w * ADV[b] / 5)
    assert stats["tis_clip_frac"] == pytest.approx(2 / 5)  # e^.2 and e^.3 exceed 1.1


def test_entropy_stat_is_masked_mean():
    ent = t([[1.0, 2.0, 3.0], [4.0, 5.0, 100.0]])
    _, stats = grpo_loss(t(LOGP), t(BEH), torch.tensor(MASK), t(ADV), clip_eps_low=LO, clip_eps_high=HI,
                         entropy=ent)
    assert stats["entropy"] == pytest.approx(15 / 5)


def test_group_advantages():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [3.0, 1.0, 2.0, 2.0]])
    std0 = math.sqrt((4 * 0.25) / 3)
    std2 = math.sqrt((1 + 1 + 0 + 0) / 3)
    want = [[0.5 / std0, -0.5 / std0, -0.5 / std0, 0.5 / std0], [0, 0, 0, 0], [1 / std2, -1 / std2, 0, 0]]
    assert torch.allclose(group_advantages(r), torch.tensor(want), atol=1e-5)
    want_dr = [[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0], [1, -1, 0, 0]]
    assert torch.equal(group_advantages(r, scale_by_std=False), torch.tensor(want_dr))


def test_chunked_logprobs_equal_full_softmax_values_and_grads():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    h1 = torch.randn(11, 8, requires_grad=True)
    h2 = h1.detach().clone().requires_grad_(True)
    y = torch.randint(0, 50, (11,))
    lp, ent = chunked_token_logprobs(h1, y, head, chunk=3)
    ref = reference_logits_logprobs(head(h2), y)
    assert torch.allclose(lp, ref, atol=1e-6)
    full = torch.log_softmax(head(h2).detach(), -1)
    assert torch.allclose(ent, -(full.exp() * full).sum(-1), atol=1e-5)
    lp.sum().backward()
    ref.sum().backward()
    assert torch.allclose(h1.grad, h2.grad, atol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_frozen_head_fused_path_equals_full_softmax_values_and_grads(temperature):
    """A frozen head (the trainer's case) goes through train_loops/head_logprobs.py: values, entropy and the
    hidden-state gradient under an arbitrary upstream gradient equal a full float64 log-softmax."""
    from train_loops import head_logprobs as hl

    torch.manual_seed(1)
    head = torch.nn.Linear(16, 97, bias=False).requires_grad_(False)
    h1 = torch.randn(23, 16, requires_grad=True)
    h2 = h1.detach().double().requires_grad_(True)
    y = torch.randint(0, 97, (23,))
    calls = []
    real = hl.HeadLogprobs.apply
    hl.HeadLogprobs.apply = lambda *a: calls.append(1) or real(*a)  # to see that the fused path ran
    try:
        lp, ent = chunked_token_logprobs(h1, y, head, chunk=5, temperature=temperature)
    finally:
        hl.HeadLogprobs.apply = real
    assert calls and not ent.requires_grad
    full = torch.log_softmax(h2 @ head.weight.double().t() / temperature, -1)
    ref = full.gather(-1, y[:, None]).squeeze(-1)
    assert torch.allclose(lp.double(), ref, atol=1e-5)
    assert torch.allclose(ent.double(), -(full.exp() * full).sum(-1).detach(), atol=1e-5)
    g = torch.randn(23)
    (lp * g).sum().backward()
    (ref * g.double()).sum().backward()
    assert torch.allclose(h1.grad.double(), h2.grad, atol=1e-5)


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_frozen_head_gradient_is_made_in_the_forward(top_p):
    """The backward makes no logits (the gradient per token is formed in the forward, head_logprobs.py), and
    in bf16 the hidden-state gradient stays within bf16 rounding of a float64 computation. The logits are
    float32 (fp32_head): bf16 logits would move the top-p nucleus against float64's, an error of the model's
    dtype (1-5% here, with or without the gradient made in the forward), not of the gradient's products."""
    from train_loops import head_logprobs as hl

    torch.manual_seed(2)
    weight = torch.randn(211, 32)
    h = torch.randn(40, 32)
    y = torch.randint(0, 211, (40,))
    g = torch.randn(40)
    h16 = h.bfloat16().requires_grad_(True)
    made = []
    real = hl._chunk_logits
    hl._chunk_logits = lambda *a, **k: made.append(1) or real(*a, **k)
    try:
        lp, _ = hl.head_logprobs(h16, y, weight.bfloat16(), chunk=16, temperature=0.9, top_p=top_p,
                                 fp32_head=True)
        in_forward = len(made)
        (lp * g).sum().backward()
    finally:
        hl._chunk_logits = real
    assert in_forward == 3 and len(made) == 3  # ceil(40 / 16) chunks, none again in the backward
    h64 = h.bfloat16().double().requires_grad_(True)
    lp64, _ = hl.head_logprobs(h64, y, weight.bfloat16().double(), chunk=16, temperature=0.9, top_p=top_p,
                               fp32_head=True)
    (lp64 * g.double()).sum().backward()
    err = (h16.grad.double() - h64.grad).norm() / h64.grad.norm()
    assert err < 5e-3, err  # measured 0.0023-0.0027; bf16's unit roundoff is 0.0039


def test_sequence_logprobs_pick_the_completion_tokens(tmp_path):
    from _train_helpers import tiny_model
    from transformers import AutoModelForCausalLM

    from common.types import Sample
    from train_loops.batches import collate

    model = AutoModelForCausalLM.from_pretrained(tiny_model(), dtype=torch.float32)
    samples = [Sample([5, 6, 7], [8, 9], [-1.0, -1.0], 1.0, 0.5, 1),
               Sample([10, 11], [12, 13, 14, 15], [-1.0] * 4, 0.0, -0.5, 1)]
    b = collate(samples, pad_id=0)
    logp, _ = sequence_logprobs(model, b["input_ids"], b["attention_mask"], b["pred_pos"], b["targets"], b["mask"],
                                chunk=2)
    for i, s in enumerate(samples):
        ids = torch.tensor([s.prompt_ids + s.completion_ids])
        full = torch.log_softmax(model(ids).logits[0].float(), -1)
        p = len(s.prompt_ids)
        want = torch.stack([full[p - 1 + j, tok] for j, tok in enumerate(s.completion_ids)])
        assert torch.allclose(logp[i, :len(s.completion_ids)], want, atol=1e-5)
        assert (logp[i, len(s.completion_ids):] == 0).all()


def test_token_denominator_makes_split_batches_equal_the_whole_batch_token_mean():
    """Two 'ranks' each with one sequence, averaged like DeepSpeed averages gradients, equal the token
    mean over both sequences when each uses the shared denominator."""
    kw = dict(clip_eps_low=LO, clip_eps_high=HI)
    whole, _ = grpo_loss(t(LOGP), t(BEH), torch.tensor(MASK), t(ADV), **kw)
    parts = [grpo_loss(t(LOGP)[i:i + 1], t(BEH)[i:i + 1], torch.tensor(MASK)[i:i + 1], t(ADV)[i:i + 1],
                       token_denominator=5 / 2, **kw)[0] for i in range(2)]
    assert (sum(parts) / 2).item() == pytest.approx(whole.item(), rel=1e-12)
