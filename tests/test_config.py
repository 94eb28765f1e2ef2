"""Config loading and validation: every broken rule fails with one message naming its key."""
import dataclasses
import typing

import pytest

from app.tiny_model import SHAPES
from common import config as C


def _load(tmp_path, text: str, sets=()):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return C.load(str(p), list(sets))


def test_defaults_validate_and_derive():
    cfg = C.load(None, [])
    assert cfg.max_loras == cfg.sync.max_staleness + 2
    assert cfg.torch_dtype == "float32"


def test_recipes_validate():
    for r in ("recipes/tiny-cpu.yaml", "recipes/qwen2.5-math-1.5b-lora-r1.yaml"):
        C.load(r, [])


def test_overrides_are_typed(tmp_path):
    cfg = _load(tmp_path, "grpo:\n  lr: 0.1\n", ["train.total_steps=7", "lora.target_modules=[q_proj, v_proj]",
                                                 "grpo.tis_cap=null", "run.mode=sync"])
    assert cfg.train.total_steps == 7 and cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.grpo.lr == 0.1 and cfg.grpo.tis_cap is None and cfg.run.mode == "sync"


@pytest.mark.parametrize("sets, key", [
    (["lora.rank=0"], "lora.rank"),
    (["lora.rank=-3"], "lora.rank"),
    (["train.zero_stage=4"], "train.zero_stage"),
    (["grpo.group_size=1"], "grpo.group_size"),
    (["sync.max_staleness=4", "sync.max_loras=5"], "sync.max_loras"),
    (["sync.mode=both"], "sync.mode"),
    (["lora.rank=16", "rollout.max_lora_rank=8"], "lora.rank"),
    (["rollout.max_lora_rank=12"], "rollout.max_lora_rank"),
    (["grpo.loss_agg=sum"], "grpo.loss_agg"),
    (["model.dtype=fp8"], "model.dtype"),
    (["train.total_steps=ten"], "train.total_steps"),
    (["router.policy=random"], "router.policy"),
    (["run.mode=lockstep"], "run.mode"),
    (["grpo.prompts_per_step=1", "grpo.group_size=2", "train.num_workers=3"], "grpo.prompts_per_step"),
    (["train.max_tokens_per_micro_batch=100", "model.max_model_len=512"], "train.max_tokens_per_micro_batch"),
    (["rollout.gpus_per_replica=1"], "rollout.gpus_per_replica"),
    (["train.use_gpu=true", "train.zero_stage=3"], "train.zero_stage"),
    (["train.use_gpu=true", "train.gpus_per_worker=2"], "train.gpus_per_worker"),
    (["sync.every=4", "sync.max_staleness=2"], "sync.every"),
    (["train.grad_accum=4"], "train.grad_accum"),
    (["lora.target_modules=[]"], "lora.target_modules"),
    (["grpo.tis_cap=0.5"], "grpo.tis_cap"),
    (["reward.fn=no_colon"], "reward.fn"),
    (["rollout.kv_cache_gib=0.5"], "rollout.kv_cache_gib"),
    (["train.profile_step=0"], "train.profile_step"),
    (["run.placement_timeout_s=0"], "run.placement_timeout_s"),
    (["train.max_restarts=-1"], "train.max_restarts"),
    (["train.mps_sm_percent=0"], "train.mps_sm_percent"),
    (["train.mps_priority=high"], "train.mps_priority"),
    (["model.tiny_shape=huge"], "model.tiny_shape"),
    (["reward.where=remote"], "reward.where"),
    (["grpo.loss=ppo"], "grpo.loss"),
    (["grpo.max_new_tokens=512", "model.max_model_len=512"], "grpo.max_new_tokens"),
    (["eval.path=builtin:letters-heldout", "data.builtin_size=5000"], "eval.path"),
])
def test_each_rule_names_its_key(sets, key):
    with pytest.raises(C.ConfigError) as refused:
        C.load(None, sets)
    assert any(p.startswith(key) for p in refused.value.problems), refused.value.problems


def test_unknown_section_and_key(tmp_path):
    with pytest.raises(C.ConfigError) as refused:
        _load(tmp_path, "grpo:\n  learning_rate: 1\nmodle:\n  path: x\n")
    assert "grpo.learning_rate: unknown key" in refused.value.problems
    assert any(p.startswith("modle: unknown section") for p in refused.value.problems)


def test_bad_files(tmp_path):
    with pytest.raises(C.ConfigError, match="not found"):
        C.load(str(tmp_path / "missing.yaml"))
    with pytest.raises(C.ConfigError, match="not valid YAML"):
        _load(tmp_path, "grpo: [unclosed\n")
    with pytest.raises(C.ConfigError, match="key=value"):
        C.load(None, ["grpo.lr"])


def test_several_problems_reported_together():
    with pytest.raises(C.ConfigError) as refused:
        C.load(None, ["lora.rank=0", "train.zero_stage=9"])
    assert len(refused.value.problems) == 2


def test_merge_fallback_reason():
    cfg = C.load(None, ["lora.use_dora=true"])
    assert "DoRA" in C.needs_merge(cfg)


def test_describe_lists_every_key():
    text = C.describe()
    for key in ("grpo.lr", "sync.max_staleness", "router.policy", "train.zero_stage", "rollout.admin_token"):
        assert key in text


def test_allowed_values_are_one_literal():
    """grpo.loss_agg and model.dtype: the Literal in common/config.py is what the validator accepts and what
    `train --help` prints; auto dtype is decided by resolve_dtype alone."""
    assert C.LOSS_AGGS == ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
    for agg in C.LOSS_AGGS:
        assert C.load(None, [f"grpo.loss_agg={agg}"]).grpo.loss_agg == agg
    assert "grpo.loss_agg (" + " | ".join(C.LOSS_AGGS) in C.describe()
    assert C.load(None, ["train.use_gpu=true"]).torch_dtype == C.resolve_dtype("auto", True) == "bfloat16"
    assert C.resolve_dtype("float16", False) == "float16"


def test_profile_step_is_typed_and_optional():
    assert C.load(None, []).train.profile_step is None
    assert C.load(None, ["train.profile_step=3"]).train.profile_step == 3
    assert "train.profile_step (int or null, default None)" in C.describe()


def _literal_fields():
    for section_name, section_type in typing.get_type_hints(C.Config).items():
        for name, annotation in typing.get_type_hints(section_type).items():
            if typing.get_origin(annotation) is typing.Literal:
                yield f"{section_name}.{name}", typing.get_args(annotation)


@pytest.mark.parametrize("key, allowed", list(_literal_fields()))
def test_every_choice_is_checked_against_its_literal(key, allowed):
    """The validator accepts exactly a Literal's values, names them when refusing one, and `describe()`
    prints them; no choice is spelled out a second time."""
    for value in allowed:
        try:
            C.load(None, [f"{key}={value}"])
        except C.ConfigError as error:  # a value may break a rule of another key (liger_kernels=on needs a GPU)
            assert not any(p.startswith(f"{key}:") and "is not" in p for p in error.problems), error.problems
    with pytest.raises(C.ConfigError) as refused:
        C.load(None, [f"{key}=not-a-choice"])
    assert any(p.startswith(f"{key}: 'not-a-choice' is not") and all(str(v) in p for v in allowed)
               for p in refused.value.problems), refused.value.problems
    assert f"  {key} ({' | '.join(str(v) for v in allowed)}, default" in C.describe()


def test_literals_name_what_other_modules_build():
    assert typing.get_args(C.TinyShape) == tuple(SHAPES)
    assert C.VLLM_LORA_RANKS == (1, 8, 16, 32, 64, 128, 256, 320, 512)


def test_each_section_states_its_own_rules():
    """A section's rules need only that section; defaults break none of them."""
    for section_type in typing.get_type_hints(C.Config).values():
        assert section_type().problems() == []
    assert C.SyncConfig(max_staleness=4, max_loras=5).problems()[0].startswith("sync.max_loras:")
    assert C.TrainConfig(profile_step=0).problems() == ["train.profile_step: must be null or >= 1, got 0"]


def test_cross_section_rules():
    """lora.rank is bound by rollout.max_lora_rank only in adapter mode (merge mode pushes full weights); a
    section with a wrongly typed field skips the cross-section rules but the other sections' rules still run."""
    C.load(None, ["lora.rank=16", "rollout.max_lora_rank=8", "sync.mode=merge"])
    with pytest.raises(C.ConfigError) as refused:
        C.load(None, ["grpo.max_new_tokens=600", "sync.every=0", "model.max_model_len=many"])
    assert refused.value.problems == ["model.max_model_len: expected int, got 'many'", "sync.every: must be >= 1"]


def test_fp32_head_with_zero3_follows_the_trainers_dtype():
    """The ZeRO-3 rule is about the trainer's tied head and embedding: a float32 trainer beside bf16 engines
    (train.dtype) may partition them; a bf16 trainer may not."""
    bf16_zero3 = ["model.dtype=bfloat16", "model.fp32_head=true", "train.zero_stage=3"]
    with pytest.raises(C.ConfigError, match="model.fp32_head: not with train.zero_stage 3 and a bf16/fp16 trainer"):
        C.load(None, bf16_zero3)
    assert C.load(None, [*bf16_zero3, "train.dtype=float32"]).trainer_dtype == "float32"


def test_lr_schedule_fields_are_checked():
    from train_loops.deepspeed_setup import lr_factor

    with pytest.raises(C.ConfigError, match="grpo.lr_schedule"):
        C.load(None, ["grpo.lr_schedule=linear"])
    with pytest.raises(C.ConfigError, match="grpo.min_lr_ratio: must be in"):
        C.load(None, ["grpo.min_lr_ratio=1.5"])
    cfg = C.load(None, ["grpo.lr_schedule=cosine", "grpo.warmup_steps=4", "train.total_steps=14"])
    f = [lr_factor(cfg, s) for s in range(14)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0] and f[4] == 1.0 and abs(f[-1] - cfg.grpo.min_lr_ratio) < 1e-12
    assert all(a >= b for a, b in zip(f[4:], f[5:]))  # cosine only goes down
    assert {lr_factor(C.load(None, []), s) for s in range(10)} == {1.0}  # constant, no warmup: unchanged


def test_round_trip_through_dict():
    cfg = C.load("recipes/qwen2.5-math-1.5b-lora-r1.yaml", ["train.profile_step=2"])
    again = C.from_dict(cfg.to_dict())
    C.validate(again)
    assert again == cfg and dataclasses.asdict(again) == cfg.to_dict()
