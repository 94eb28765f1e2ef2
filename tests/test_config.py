"""Config loading and validation: every broken rule fails with one message naming its key."""
import pytest

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
])
def test_each_rule_names_its_key(sets, key):
    with pytest.raises(C.ConfigError) as e:
        C.load(None, sets)
    assert any(p.startswith(key) for p in e.value.problems), e.value.problems


def test_unknown_section_and_key(tmp_path):
    with pytest.raises(C.ConfigError) as e:
        _load(tmp_path, "grpo:\n  learning_rate: 1\nmodle:\n  path: x\n")
    assert "grpo.learning_rate: unknown key" in e.value.problems
    assert any(p.startswith("modle: unknown section") for p in e.value.problems)


def test_bad_files(tmp_path):
    with pytest.raises(C.ConfigError, match="not found"):
        C.load(str(tmp_path / "missing.yaml"))
    with pytest.raises(C.ConfigError, match="not valid YAML"):
        _load(tmp_path, "grpo: [unclosed\n")
    with pytest.raises(C.ConfigError, match="key=value"):
        C.load(None, ["grpo.lr"])


def test_several_problems_reported_together():
    with pytest.raises(C.ConfigError) as e:
        C.load(None, ["lora.rank=0", "train.zero_stage=9"])
    assert len(e.value.problems) == 2


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
