"""The policy-loss registry (train_loops/losses.py): each loss against numbers written out by hand on
small tensors, and, for every loss, gradients summed over unequal micro-batches (and two "ranks") equal
the whole batch's gradient."""
import math
import typing

import pytest
import torch

from common import config as C
from common.config import GRPOConfig
from common.loss_names import LOSS_NAMES
from train_loops.losses import LOSSES, agg_loss, get_policy_loss, register_policy_loss

# Two sequences of uneven length; the second's last position is padding (its values must not matter).
LOGP = [[-1.0, -2.0, -0.5], [-1.5, -0.3, -9.0]]
BEH = [[-1.2, -1.5, -0.5], [-1.0, -0.6, -1.0]]
REF = [[-1.1, -1.8, -0.7], [-1.4, -0.5, -3.0]]
MASK = [[1, 1, 1], [1, 1, 0]]
ADV = [1.0, -0.5]
REAL = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
# log-ratios logp - behaviour on the real tokens: 0.2, -0.5, 0.0 | -0.5, 0.3


def t(x, **kw):
    return torch.tensor(x, dtype=torch.float64, **kw)


def run(name, opts, td, sd, kl=False, logp=None, agg_override=None):
    logp = t(LOGP, requires_grad=True) if logp is None else logp
    loss, stats = get_policy_loss(name)(logp, t(BEH), torch.tensor(MASK), t(ADV), opts=opts,
                                        ref_logp=t(REF) if kl else None, token_denominator=td, seq_denominator=sd)
    loss.backward()
    return loss.item(), logp.grad, stats


def ppo_token(b, j, lo, hi):
    r = math.exp(LOGP[b][j] - BEH[b][j])
    a = ADV[b]
    return -min(r * a, min(max(r, 1 - lo), 1 + hi) * a)


def k3(b, j):
    d = REF[b][j] - LOGP[b][j]
    return math.exp(d) - d - 1


# ---------------------------------------------------------------- registry and config

def test_registry_is_the_config_list():
    assert LOSSES == LOSS_NAMES == ("grpo", "dr_grpo", "gspo", "cispo", "dapo")
    assert typing.get_args(typing.get_type_hints(GRPOConfig)["loss"]) == LOSSES  # what the config accepts
    for name in LOSSES:
        assert callable(get_policy_loss(name))
    with pytest.raises(ValueError, match="grpo.loss: 'ppo' is not one of"):
        get_policy_loss("ppo")
    with pytest.raises(ValueError, match="POLICY_LOSSES"):
        register_policy_loss("not-in-config")


def test_config_validates_loss_and_options():
    cfg = C.load(None, ["grpo.loss=gspo"])
    assert cfg.grpo.loss == "gspo" and cfg.scale_advantages
    assert not C.load(None, ["grpo.loss=dr_grpo"]).scale_advantages
    with pytest.raises(C.ConfigError, match="grpo.loss: 'ppo' is not one of grpo, dr_grpo, gspo, cispo, dapo"):
        C.load(None, ["grpo.loss=ppo"])
    with pytest.raises(C.ConfigError, match="grpo.tis_cap: applies to"):
        C.load(None, ["grpo.loss=cispo", "grpo.tis_cap=2.0"])
    with pytest.raises(C.ConfigError, match="grpo.dapo_overlong_buffer"):
        C.load(None, ["grpo.dapo_overlong_buffer=16", "grpo.max_new_tokens=16"])
    with pytest.raises(C.ConfigError, match="grpo.cispo_eps_low"):
        C.load(None, ["grpo.cispo_eps_low=1.5"])
    text = C.describe()
    for key in ("grpo.loss", "grpo.gspo_clip_eps_low", "grpo.cispo_eps_high", "grpo.dr_grpo_norm_len",
                "grpo.dapo_overlong_buffer", "grpo.dapo_overlong_penalty", "grpo.dynamic_sampling"):
        assert key in text
    for name in LOSSES:
        assert f"      {name}: " in text


# ---------------------------------------------------------------- the reducer

def test_agg_loss_uses_the_step_denominators():
    per = t([[1.0, 2.0, 3.0], [4.0, 5.0, 100.0]])
    m = torch.tensor(MASK)
    assert agg_loss(per, m, "token-mean", token_denominator=10.0, seq_denominator=99).item() == 15 / 10
    assert agg_loss(per, m, "seq-mean-token-mean", token_denominator=99, seq_denominator=4.0).item() == \
        pytest.approx((6 / 3 + 9 / 2) / 4)
    assert agg_loss(per, m, "seq-mean-token-sum", token_denominator=99, seq_denominator=4.0).item() == 15 / 4
    assert agg_loss(per, m, "seq-mean-token-sum-norm", token_denominator=99, seq_denominator=4.0,
                    norm_len=5).item() == 15 / 20
    with pytest.raises(ValueError, match="loss_agg"):
        agg_loss(per, m, "sum", token_denominator=1, seq_denominator=1)


# ---------------------------------------------------------------- each loss, by hand

@pytest.mark.parametrize("agg", C.LOSS_AGGS)
def test_grpo_by_hand_with_given_denominators(agg):
    opts = GRPOConfig(clip_eps_low=0.2, clip_eps_high=0.3, loss_agg=agg)
    loss, grad, stats = run("grpo", opts, td=10.0, sd=4.0)
    tok = {bj: ppo_token(*bj, 0.2, 0.3) for bj in REAL}
    if agg == "token-mean":
        want = sum(tok.values()) / 10
    elif agg == "seq-mean-token-mean":
        want = ((tok[0, 0] + tok[0, 1] + tok[0, 2]) / 3 + (tok[1, 0] + tok[1, 1]) / 2) / 4
    else:
        want = sum(tok.values()) / 4
    assert loss == pytest.approx(want, rel=1e-12)
    assert grad[1, 0] == 0.0 and grad[1, 2] == 0.0  # clipped (r = e^-.5 < .8 with A < 0); padding
    assert stats["clip_frac"] == pytest.approx(1 / 5) and stats["tokens"] == 5


def test_dr_grpo_divides_token_sums_by_a_constant():
    opts = GRPOConfig(clip_eps_low=0.2, clip_eps_high=0.3, dr_grpo_norm_len=4, loss_agg="token-mean")
    loss, grad, _ = run("dr_grpo", opts, td=123.0, sd=2.0)  # td unused; loss_agg ignored
    tok = {bj: ppo_token(*bj, 0.2, 0.3) for bj in REAL}
    assert loss == pytest.approx(sum(tok.values()) / (4 * 2), rel=1e-12)
    # every unclipped token weighs 1 / (L x S), whatever its sequence's length
    assert grad[0, 0].item() == pytest.approx(-math.exp(0.2) * 1.0 / 8)
    assert grad[1, 1].item() == pytest.approx(-math.exp(0.3) * -0.5 / 8)
    assert grad[1, 0] == 0.0
    # default constant: max_new_tokens
    loss2, _, _ = run("dr_grpo", GRPOConfig(clip_eps_low=0.2, clip_eps_high=0.3, max_new_tokens=8), td=1.0, sd=2.0)
    assert loss2 == pytest.approx(sum(tok.values()) / (8 * 2), rel=1e-12)


def test_gspo_sequence_ratio_and_sequence_clipping():
    s0 = math.exp((0.2 - 0.5 + 0.0) / 3)  # 0.905: A > 0, the lower bound does not bind -> unclipped
    s1 = math.exp((-0.5 + 0.3) / 2)  # 0.905 < 1 - 3e-4 with A < 0 -> the whole sequence is clipped
    # model_construct skips validation: a loss_agg no config could hold, to show gspo never reads it
    opts = GRPOConfig.model_construct(gspo_clip_eps_low=3e-4, gspo_clip_eps_high=4e-4, loss_agg="token-sum-ignored")
    loss, grad, stats = run("gspo", opts, td=99.0, sd=2.0)
    row0 = -min(s0 * 1.0, min(max(s0, 1 - 3e-4), 1 + 4e-4) * 1.0)
    row1 = -min(s1 * -0.5, min(max(s1, 1 - 3e-4), 1 + 4e-4) * -0.5)
    assert loss == pytest.approx((row0 + row1) / 2, rel=1e-12)
    for j in range(3):  # d/dlogp_t of -s0 A / |y| / S: s0 = exp(mean log-ratio) -> s0 / 3
        assert grad[0, j].item() == pytest.approx(-s0 * 1.0 / 3 / 2)
    assert torch.all(grad[1] == 0)
    assert stats["clip_frac"] == pytest.approx(2 / 5)  # both tokens of the clipped sequence
    # wide clip range: both sequences unclipped, sequence 1's tokens get -s1 A / 2 / S each
    _, grad, stats = run("gspo", GRPOConfig(gspo_clip_eps_low=0.2, gspo_clip_eps_high=0.2), td=99.0, sd=2.0)
    assert grad[1, 0].item() == pytest.approx(-s1 * -0.5 / 2 / 2) and grad[1, 2] == 0.0
    assert stats["clip_frac"] == 0.0


def test_cispo_clipped_detached_weight_keeps_every_token():
    opts = GRPOConfig(cispo_eps_low=1.0, cispo_eps_high=0.28, loss_agg="token-mean")
    loss, grad, stats = run("cispo", opts, td=5.0, sd=2.0)
    w = {bj: min(math.exp(LOGP[bj[0]][bj[1]] - BEH[bj[0]][bj[1]]), 1.28) for bj in REAL}  # no lower bound
    want = sum(-w[b, j] * ADV[b] * LOGP[b][j] for b, j in REAL) / 5
    assert loss == pytest.approx(want, rel=1e-12)
    for b, j in REAL:  # gradient -sg(w) A / N on every token, the one PPO would clip (1, 0) included
        assert grad[b, j].item() == pytest.approx(-w[b, j] * ADV[b] / 5)
    assert grad[1, 0] != 0.0 and grad[1, 2] == 0.0
    assert stats["clip_frac"] == pytest.approx(1 / 5)  # e^.3 > 1.28
    # a lower bound, when set, lifts small weights
    _, grad, _ = run("cispo", GRPOConfig(cispo_eps_low=0.2, cispo_eps_high=0.28), td=5.0, sd=2.0)
    assert grad[1, 0].item() == pytest.approx(-0.8 * -0.5 / 5)


def test_dapo_clip_higher_and_token_mean():
    opts = GRPOConfig(dapo_clip_eps_low=0.2, dapo_clip_eps_high=0.28, loss_agg="seq-mean-token-sum")
    loss, grad, stats = run("dapo", opts, td=5.0, sd=2.0)
    tok = {bj: ppo_token(*bj, 0.2, 0.28) for bj in REAL}
    assert loss == pytest.approx(sum(tok.values()) / 5, rel=1e-12)  # token mean whatever loss_agg says
    # r = e^.2 = 1.22 with A > 0: inside 1.28 (clip-higher); grpo at 0.2/0.2 clips it to no gradient
    assert grad[0, 0].item() == pytest.approx(-math.exp(0.2) / 5)
    _, grad_grpo, _ = run("grpo", GRPOConfig(clip_eps_low=0.2, clip_eps_high=0.2), td=5.0, sd=2.0)
    assert grad_grpo[0, 0] == 0.0
    assert stats["clip_frac"] == pytest.approx(1 / 5)


@pytest.mark.parametrize("name", LOSSES)
def test_kl_is_added_per_token_in_each_losses_reduction(name):
    opts = GRPOConfig(kl_coef=0.1, clip_eps_low=0.2, clip_eps_high=0.3, max_new_tokens=4)
    with_kl, _, stats = run(name, opts, td=5.0, sd=2.0, kl=True)
    without, _, _ = run(name, opts.replace(kl_coef=0.0), td=5.0, sd=2.0)
    kl = {bj: k3(*bj) for bj in REAL}
    agg = {"grpo": sum(kl.values()) / 5, "cispo": sum(kl.values()) / 5, "dapo": sum(kl.values()) / 5,
           "dr_grpo": sum(kl.values()) / (4 * 2),
           "gspo": ((kl[0, 0] + kl[0, 1] + kl[0, 2]) / 3 + (kl[1, 0] + kl[1, 1]) / 2) / 2}[name]
    assert with_kl - without == pytest.approx(0.1 * agg, rel=1e-10)
    assert stats["kl"] == pytest.approx(sum(kl.values()) / 5)
    assert stats["log_ratio_abs_mean"] == pytest.approx((0.2 + 0.5 + 0.0 + 0.5 + 0.3) / 5)
    assert stats["log_ratio_abs_max"] == pytest.approx(0.5)


def test_grpo_tis_stats_and_entropy():
    opts = GRPOConfig(clip_eps_low=0.2, clip_eps_high=0.3, tis_cap=1.1)
    logp = t(LOGP, requires_grad=True)
    loss, stats = get_policy_loss("grpo")(logp, t(BEH), torch.tensor(MASK), t(ADV), opts=opts,
                                          entropy=t([[1.0, 2.0, 3.0], [4.0, 5.0, 100.0]]),
                                          token_denominator=5.0, seq_denominator=2.0)
    loss.backward()
    w = {bj: min(math.exp(LOGP[bj[0]][bj[1]] - BEH[bj[0]][bj[1]]), 1.1) for bj in REAL}
    for b, j in REAL:
        assert logp.grad[b, j].item() == pytest.approx(-w[b, j] * ADV[b] / 5)
    assert stats["tis_weight_mean"] == pytest.approx(sum(w.values()) / 5)
    assert stats["tis_clip_frac"] == pytest.approx(2 / 5)
    assert stats["entropy"] == pytest.approx(15 / 5)


# ---------------------------------------------------------------- any split, same gradient

def _random_batch(seed, per_token_adv):
    g = torch.Generator().manual_seed(seed)
    B, T = 7, 9
    lengths = [9, 1, 5, 3, 8, 2, 6]
    mask = torch.zeros(B, T, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    logp = -torch.rand(B, T, generator=g) * 2 - 0.05
    beh = logp + 0.3 * torch.randn(B, T, generator=g)
    ref = logp + 0.2 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g) if per_token_adv else torch.randn(B, generator=g)
    return logp.float(), beh.float(), ref.float(), mask, adv.float()


def _grad(name, opts, logp, beh, ref, mask, adv, rows, td, sd):
    x = logp[rows].clone().requires_grad_(True)
    loss, _ = get_policy_loss(name)(x, beh[rows], mask[rows], adv[rows], opts=opts, ref_logp=ref[rows],
                                    token_denominator=td, seq_denominator=sd)
    loss.backward()
    full = torch.zeros_like(logp)
    full[rows] = x.grad
    return loss.detach(), full


OPTS = [("grpo", dict(loss_agg=a, tis_cap=c)) for a in C.LOSS_AGGS for c in (None, 1.5)] + [
    ("dr_grpo", {}), ("dr_grpo", dict(dr_grpo_norm_len=5)),
    ("gspo", dict(gspo_clip_eps_low=0.1, gspo_clip_eps_high=0.1)), ("gspo", {}),
    ("cispo", dict(loss_agg="token-mean")), ("cispo", dict(loss_agg="seq-mean-token-mean")),
    ("dapo", {})]


@pytest.mark.parametrize("per_token_adv", [False, True])
@pytest.mark.parametrize("name,kw", OPTS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(OPTS)])
def test_micro_batch_gradients_sum_to_the_whole_batch_gradient(name, kw, per_token_adv):
    assert name in LOSSES
    opts = GRPOConfig(kl_coef=0.05, max_new_tokens=9, **kw)
    logp, beh, ref, mask, adv = _random_batch(7, per_token_adv)
    B, N = mask.shape[0], int(mask.sum())
    whole_loss, whole = _grad(name, opts, logp, beh, ref, mask, adv, list(range(B)), float(N), float(B))
    assert whole.abs().sum() > 0

    # one rank, unequal micro-batches
    parts = [_grad(name, opts, logp, beh, ref, mask, adv, rows, float(N), float(B))
             for rows in ([3], [0, 5, 1], [6, 2, 4])]
    assert torch.allclose(sum(p[1] for p in parts), whole, rtol=1e-5, atol=1e-7)
    assert float(sum(p[0] for p in parts)) == pytest.approx(float(whole_loss), rel=1e-5, abs=1e-7)

    # two ranks of unequal size, each with its own micro-batches; denominators / world, gradients averaged
    world = 2
    ranks = [([0, 1], [2, 3]), ([4], [5, 6])]
    rank_grads = [sum(_grad(name, opts, logp, beh, ref, mask, adv, rows, N / world, B / world)[1] for rows in r)
                  for r in ranks]
    assert torch.allclose(sum(rank_grads) / world, whole, rtol=1e-5, atol=1e-7)
