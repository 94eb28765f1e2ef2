"""Behaviour logprobs from the trainer (`rollout.behaviour_logprobs: trainer`, train_loops/behaviour.py), on the
tiny model in float32 with real PEFT: the pre-pass under a kept older version equals a plain PEFT forward with
that version's adapter loaded; fresh samples' loss and gradient equal engine mode's when the engine's logprobs
equal the trainer's; which versions are kept across publishes, tags and steps off the sync grid; the config
rule. The end-to-end run is tests/test_judge_run.py (a judged run with trainer behaviour logprobs)."""
from __future__ import annotations

import math

import pytest
import torch

from common import config as C
from common.types import Sample
from tests._train_helpers import small_config, tiny_model
from train_loops import micro_batches as mb
from train_loops.batches import collate
from train_loops.behaviour import VersionWeights, fill_from_forward, prepass, scoreable
from train_loops.lora import build_lora_model
from train_loops.losses import get_policy_loss
from train_loops.policy import PolicyLogprobs


def _samples(vocab: int, n: int, version: int, engine: bool = False, seed: int = 0) -> list[Sample]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(3, vocab, (int(torch.randint(3, 9, (1,), generator=gen)),), generator=gen).tolist()
        comp = torch.randint(3, vocab, (int(torch.randint(2, 10, (1,), generator=gen)),), generator=gen).tolist()
        out.append(Sample(prompt_ids=prompt, completion_ids=comp,
                          behaviour_logprobs=[-1.0] * len(comp) if engine else None,
                          reward=float(i % 2), advantage=1.0 if i % 2 else -1.0, version=version,
                          prompt_id=f"p{i}", group_id=f"v{version}"))
    return out


def _randomize_lora(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))


def _lora_state(model) -> dict:
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


@pytest.fixture(scope="module")
def cfg():
    return small_config(tiny_model(), train={"num_workers": 1, "fused_lora": True},
                        rollout={"behaviour_logprobs": "trainer"})


def _plain_peft_logprobs(cfg, state: dict, sample: Sample) -> torch.Tensor:
    """The reference: stock PEFT LoRA (no fused linear) with `state` loaded, one unpadded sequence, a full
    log-softmax over the vocabulary."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    from train_loops.lora import load_base_model

    lo = cfg.lora
    ref = get_peft_model(load_base_model(cfg.model.path), LoraConfig(
        r=lo.rank, lora_alpha=lo.alpha, target_modules=lo.target_modules, task_type="CAUSAL_LM", bias="none"))
    set_peft_model_state_dict(ref, state)
    ref.eval()
    ids = torch.tensor([sample.prompt_ids + sample.completion_ids])
    with torch.no_grad():
        logits = ref(input_ids=ids).logits[0].float()
    n_prompt = len(sample.prompt_ids)
    logp = torch.log_softmax(logits[n_prompt - 1:-1], dim=-1)
    return logp.gather(1, torch.tensor(sample.completion_ids)[:, None])[:, 0]


def test_prepass_under_a_kept_version_equals_plain_peft_with_that_adapter(cfg):
    model = build_lora_model(cfg)
    forward = PolicyLogprobs(model, chunk=16)
    weights = VersionWeights(model, max_staleness=2)
    _randomize_lora(model, 1)
    v1_state = _lora_state(model)
    weights.after_step({"version": 1, "published": 1})
    _randomize_lora(model, 2)
    current = {n: p.detach().clone() for n, p in weights.params.items()}
    weights.after_step({"version": 2, "published": 1})
    assert weights.live == 2 and sorted(weights.saved) == [1, 2]

    vocab = model.config.vocab_size
    stale, fresh, engine = _samples(vocab, 5, 1, seed=1), _samples(vocab, 2, 2, seed=2), _samples(vocab, 2, 1, True, 3)
    model.train()
    filled, stats = prepass(stale + fresh + engine, weights, forward, collate,
                            lambda s: mb.pack(s, 40), model)  # a small budget: several micro-batches
    assert stats["behaviour_trainer_samples"] == 7 and stats["behaviour_prepass_samples"] == 5
    assert all(id(s) not in filled for s in engine)  # the engine's logprobs stay
    for s in fresh:  # the live version: left to the training forward
        assert all(math.isnan(x) for x in filled[id(s)].behaviour_logprobs)
    for s in stale:
        got = torch.tensor(filled[id(s)].behaviour_logprobs)
        torch.testing.assert_close(got, _plain_peft_logprobs(cfg, v1_state, s), atol=2e-5, rtol=1e-5)
    # the current weights and train mode are back, exactly
    assert model.training
    for n, p in weights.params.items():
        assert torch.equal(p, current[n]), n


def test_fresh_samples_loss_and_gradient_equal_engine_mode_at_ratio_one(cfg):
    model = build_lora_model(cfg)
    _randomize_lora(model, 3)
    forward = PolicyLogprobs(model, chunk=16)
    loss_fn = get_policy_loss(cfg.grpo.loss)
    params = [p for p in model.parameters() if p.requires_grad]
    trainer_samples = _samples(model.config.vocab_size, 6, 0, seed=4)

    def loss_and_grads(samples, fill: bool, shift: float = 0.0):
        model.zero_grad()
        tensors = collate(samples)
        logp, entropy = forward(**{k: tensors[k] for k in ("input_ids", "attention_mask", "pred_pos", "targets",
                                                          "mask")})
        behaviour = fill_from_forward(tensors["behaviour_logp"], logp) if fill else tensors["behaviour_logp"]
        loss, _ = loss_fn(logp, behaviour + shift, tensors["mask"], tensors["advantages"], opts=cfg.grpo,
                          entropy=entropy, token_denominator=float(tensors["mask"].sum()),
                          seq_denominator=float(len(samples)))
        loss.backward()
        return float(loss.detach()), [p.grad.clone() for p in params], logp.detach()

    loss_t, grads_t, logp = loss_and_grads(trainer_samples, fill=True)
    # engine mode, the engine having returned exactly the trainer's logprobs
    engine_samples = [Sample(**{**s.__dict__, "behaviour_logprobs": logp[i, :len(s.completion_ids)].tolist()})
                      for i, s in enumerate(trainer_samples)]
    loss_e, grads_e, _ = loss_and_grads(engine_samples, fill=False)
    assert loss_t == pytest.approx(loss_e, abs=1e-7)
    for gt, ge in zip(grads_t, grads_e):
        torch.testing.assert_close(gt, ge, atol=1e-7, rtol=1e-6)
    assert any(float(g.abs().max()) > 0 for g in grads_t)
    # behaviour logprobs off by 0.5 clip the ratio: a different gradient (the comparison above can fail)
    _, grads_off, _ = loss_and_grads(engine_samples, fill=False, shift=0.5)
    assert any(not torch.allclose(a, b) for a, b in zip(grads_t, grads_off))


def test_kept_versions_follow_publishes_tags_and_the_sync_grid():
    model = torch.nn.Linear(2, 2)
    w = VersionWeights(model, max_staleness=1)
    w.start(0)
    assert w.live == 0 and sorted(w.saved) == [0]
    with torch.no_grad():
        model.weight.add_(1.0)
    w.after_step({"version": 1, "published": 0, "aliased": 0})  # off the sync.every grid: nothing served
    assert w.live is None and sorted(w.saved) == [0]
    w.after_step({"version": 2, "published": 1})
    assert w.live == 2 and sorted(w.saved) == [2]  # version 0 fell out of max_staleness 1
    w.after_step({"version": 3, "aliased": 1, "max_delta": 0.0})  # a tag, the weights unchanged
    assert w.live == 3 and w.saved[3] is w.saved[2]
    w.after_step({"version": 4, "aliased": 1, "max_delta": 1e-3})  # a tag within a nonzero threshold
    assert w.live is None and w.saved[4] is w.saved[3] and sorted(w.saved) == [3, 4]

    def sample(version, engine=False):
        return Sample(prompt_ids=[1], completion_ids=[2], behaviour_logprobs=[0.0] if engine else None, reward=0.0,
                      advantage=0.0, version=version)

    kept, dropped = scoreable([sample(4), sample(3), sample(2), sample(2, engine=True)], w)
    assert dropped == 1 and [s.version for s in kept] == [4, 3, 2]
    assert not VersionWeights(model, 1, enabled=False).saved


def test_rule_refuses_trainer_logprobs_under_zero3_naming_both_keys():
    with pytest.raises(C.ConfigError) as refused:
        C.load(None, ["rollout.behaviour_logprobs=trainer", "train.zero_stage=3"])
    msg = next(p for p in refused.value.problems if p.startswith("rollout.behaviour_logprobs:"))
    assert "train.zero_stage 3" in msg and "rollout.behaviour_logprobs engine" in msg
    C.load(None, ["rollout.behaviour_logprobs=trainer", "train.zero_stage=2"])  # accepted
    with pytest.raises(C.ConfigError, match="rollout.behaviour_logprobs: 'vllm' is not engine or trainer"):
        C.load(None, ["rollout.behaviour_logprobs=vllm"])
    with pytest.raises(C.ConfigError, match="rollout.engine_logprobs_every"):
        C.load(None, ["rollout.engine_logprobs_every=-1"])


def test_rollout_side_asks_the_engine_every_nth_group_and_episodes_carry_none():
    from types import SimpleNamespace

    from app.episodes import Episode
    from app.rollout_worker import RolloutWorker

    def asked(sets, n=7):
        # the counter alone: a whole RolloutWorker needs Ray actors and a tokenizer, which this rule never reads
        stub = SimpleNamespace(cfg=C.load(None, sets), _groups_started=0)
        return [RolloutWorker.__ray_actor_class__._engine_logprobs(stub) for _ in range(n)]

    assert asked([]) == [True] * 7  # engine mode: every group
    assert asked(["rollout.behaviour_logprobs=trainer", "rollout.engine_logprobs_every=3"]) == [
        True, False, False, True, False, False, True]
    assert asked(["rollout.behaviour_logprobs=trainer", "rollout.engine_logprobs_every=0"]) == [False] * 7

    turn = {"token_ids": [5, 6], "prompt_token_ids": [1, 2], "version": 3, "text": "x"}
    ep = Episode(prompt_ids=[1, 2])
    ep.add_turn({**turn, "logprobs": []})  # sampled without logprobs
    ep.add_context([7, 8, 9], [])
    ep.add_turn({**turn, "logprobs": []})
    assert ep.logprobs is None and ep.mask == [1, 1, 0, 0, 0, 1, 1]
    ep = Episode(prompt_ids=[1, 2])
    ep.add_turn({**turn, "logprobs": [-0.5, -0.25]})
    ep.add_context([7], [])
    assert ep.logprobs == [-0.5, -0.25, 0.0]
    with pytest.raises(RuntimeError, match="2 tokens but 1 logprobs"):
        ep.add_turn({**turn, "logprobs": [-0.5]})
