"""train_loops/lora_linear.py against PEFT's own LoRA Linear on the tiny model (float32, CPU): the same
outputs and LoRA gradients, the same state dict, the adapter-disabled (reference) path is the base
model, and a DoRA config still gets PEFT's forward."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _train_helpers import small_config, tiny_model  # noqa: E402


def _model(fused: bool, **lora):
    from train_loops.lora import build_lora_model

    cfg = small_config(tiny_model(), train={"fused_lora": fused}, lora=lora)
    m = build_lora_model(cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # non-zero B, so the update matters
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return m


def _grads(m, ids):
    m.zero_grad()
    out = m(input_ids=ids).logits
    (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("rank", [8, 1])
def test_fused_lora_linear_matches_peft_outputs_and_gradients(rank):
    """At rank 1 the fused layer runs its own autograd function (base product and rank-1 update in one)."""
    from train_loops import lora_linear
    from train_loops.lora_linear import FusedLoraLinear

    ids = torch.randint(3, 60, (3, 17))
    peft_m, fused_m = _model(False, rank=rank), _model(True, rank=rank)
    assert any(isinstance(m, FusedLoraLinear) for m in fused_m.modules())
    assert not any(isinstance(m, FusedLoraLinear) for m in peft_m.modules())
    assert peft_m.state_dict().keys() == fused_m.state_dict().keys()
    for (n, a), b in zip(peft_m.state_dict().items(), fused_m.state_dict().values()):
        assert torch.equal(a, b), n
    out_p, g_p = _grads(peft_m, ids)
    from peft.tuners.lora.layer import Linear

    calls, real = [], Linear.forward
    rank1, real_apply = [], lora_linear._Rank1Lora.apply
    Linear.forward = lambda self, *a, **k: calls.append(1) or real(self, *a, **k)
    lora_linear._Rank1Lora.apply = lambda *a: rank1.append(1) or real_apply(*a)
    try:
        out_f, g_f = _grads(fused_m, ids)
    finally:
        Linear.forward = real
        lora_linear._Rank1Lora.apply = real_apply
    assert not calls  # the fused forward ran, not PEFT's
    assert bool(rank1) == (rank == 1)
    # float32 rounding only (the rank-1 function sums in another order): ~1e-7 of the norm; a wrong scaling,
    # transpose or missing term is off by far more
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(out_f, out_p) < 1e-5
    assert g_p.keys() == g_f.keys() and g_p
    for n in g_p:
        assert rel(g_f[n], g_p[n]) < 1e-5, n
    with fused_m.disable_adapter(), peft_m.disable_adapter(), torch.no_grad():
        assert torch.allclose(fused_m(input_ids=ids).logits, peft_m(input_ids=ids).logits, atol=1e-6)
        base = fused_m(input_ids=ids).logits
    assert not torch.allclose(base, out_f, atol=1e-3)  # the adapter changes the output


@pytest.mark.parametrize("lora", [{"use_dora": True}, {"dropout": 0.1}])
def test_other_lora_variants_take_peft_forward(lora):
    from peft.tuners.lora.layer import Linear

    torch.manual_seed(0)
    fused_m, peft_m = _model(True, **lora), _model(False, **lora)
    ids = torch.randint(3, 60, (2, 9))
    fused_m.eval(), peft_m.eval()  # dropout off, so both are deterministic
    calls = []
    real = Linear.forward
    Linear.forward = lambda self, *a, **k: calls.append(1) or real(self, *a, **k)
    try:
        with torch.no_grad():
            out = fused_m(input_ids=ids).logits
    finally:
        Linear.forward = real
    assert calls  # PEFT's forward ran
    with torch.no_grad():
        assert torch.allclose(out, peft_m(input_ids=ids).logits, atol=1e-5)
