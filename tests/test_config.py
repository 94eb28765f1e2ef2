"""Config loading and validation: every broken rule fails with one message naming its key, the value and what
is accepted; every recipe loads; a Config is frozen, round-trips to its workers, and derives its values once."""
import pickle
import typing
from pathlib import Path

import pydantic
import pytest

from app.tiny_model import SHAPES
from common import config as C

RECIPES = sorted(str(p) for p in (Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))


def _load(tmp_path, text: str, sets=()):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return C.load(str(p), list(sets))


def _problems(sets) -> list[str]:
    with pytest.raises(C.ConfigError) as refused:
        C.load(None, sets)
    return refused.value.problems


def test_defaults_validate_and_derive():
    cfg = C.load(None, [])
    assert cfg.sync.live_versions == cfg.sync.max_staleness + 1 == 3
    assert cfg.adapter_slots == cfg.replica_slots == 4
    assert cfg.torch_dtype == "float32"


def test_derived_slots_follow_staleness_eval_and_max_loras():
    """live_versions is the registry's keep window; adapter_slots adds the swap slot and, with evaluation, one
    for the version under evaluation; replica_slots is sync.max_loras when set."""
    cfg = C.load(None, ["sync.max_staleness=4"])
    assert (cfg.sync.live_versions, cfg.adapter_slots, cfg.replica_slots) == (5, 6, 6)
    cfg = C.load(None, ["sync.max_staleness=0", "eval.path=builtin:letters-heldout"])
    assert (cfg.sync.live_versions, cfg.adapter_slots) == (1, 3)
    assert C.load(None, ["sync.max_loras=9"]).replica_slots == 9
    assert any(p.startswith("sync.max_loras: 4 < 5 adapter slots") and "evaluation" in p
               for p in _problems(["sync.max_loras=4", "eval.path=builtin:letters-heldout"]))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: Path(p).name)
def test_every_recipe_loads(recipe):
    cfg = C.load(recipe, [])
    assert C.from_dict(cfg.to_dict()) == cfg


def test_overrides_are_typed(tmp_path):
    cfg = _load(tmp_path, "grpo:\n  lr: 0.1\n", ["train.total_steps=7", "lora.target_modules=[q_proj, v_proj]",
                                                 "grpo.tis_cap=null", "run.mode=sync", "grpo.min_lr_ratio=1e-2"])
    assert cfg.train.total_steps == 7 and cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.grpo.lr == 0.1 and cfg.grpo.tis_cap is None and cfg.run.mode == "sync"
    assert cfg.grpo.min_lr_ratio == 0.01
    # a line with ": " in it is text, not a one-line YAML mapping; collections are written {..} or [..]
    template = "Reply Y or N. The reply was: {completion}"
    cfg = C.load(None, [f"reward.judge.template={template}", "data.few_shot=[{prompt: q, answer: a}]",
                        "data.system_prompt=Answer: one letter. - no more",
                        'reward.judge.parse={"kind": "words", "yes": [Y], "no": [N]}'])
    assert cfg.reward.judge.template == template and cfg.reward.judge.parse.yes == ["Y"]
    assert cfg.data.few_shot[0]["prompt"] == "q" and cfg.data.system_prompt == "Answer: one letter. - no more"


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
    (["train.use_gpu=true", "rollout.gpus_per_replica=0.5", "model.dtype=float32"], "model.dtype"),
    (["train.use_gpu=true", "train.zero_stage=3"], "train.zero_stage"),
    (["train.use_gpu=true", "train.gpus_per_worker=2"], "train.gpus_per_worker"),
    (["sync.every=4", "sync.max_staleness=2"], "sync.every"),
    (["train.grad_accum=4"], "train.grad_accum"),
    (["lora.target_modules=[]"], "lora.target_modules"),
    (["grpo.tis_cap=0.5"], "grpo.tis_cap"),
    (["grpo.tis_cap=2", "grpo.loss=cispo"], "grpo.tis_cap"),
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
    (["data.few_shot=[{prompt: q}]"], "data.few_shot[0]"),
    (["run.tracking_project=''"], "run.tracking_project"),
    (["train.liger_kernels=on"], "train.liger_kernels"),
])
def test_each_rule_names_its_key(sets, key):
    assert any(p.startswith(key + ":") for p in _problems(sets)), _problems(sets)


@pytest.mark.parametrize("sets, message", [
    (["grpo.lr=-1"], "grpo.lr: must be > 0, got -1"),
    (["lora.dropout=1.0"], "lora.dropout: must be in [0, 1), got 1.0"),
    (["train.mps_sm_percent=101"], "train.mps_sm_percent: must be in [1, 100], got 101"),
    (["grpo.top_p=0"], "grpo.top_p: must be in (0, 1], got 0"),
    (["train.profile_step=0"], "train.profile_step: must be >= 1 or null, got 0"),
    (["train.max_minutes=0"], "train.max_minutes: must be > 0 or null, got 0"),
    (["train.total_steps=ten"], "train.total_steps: expected int, got 'ten'"),
    (["train.use_gpu=maybe"], "train.use_gpu: expected bool, got 'maybe'"),
    (["rollout.kv_cache_gib=0.5"], "rollout.kv_cache_gib: expected int, got 0.5"),
    (["train.zero_stage=4"], "train.zero_stage: 4 is not one of 0, 1, 2, 3"),
    (["run.loggers=[neptune]"], "run.loggers[0]: 'neptune' is not one of jsonl, tensorboard, mlflow, wandb"),
    (["rollout.cudagraph_capture_sizes=[0,8]"],
     "rollout.cudagraph_capture_sizes: batch sizes >= 1, at least one (null: vLLM's own), got [0, 8]"),
])
def test_pydantic_errors_become_one_line_messages(sets, message):
    """Pydantic's constraint and type errors read like the hand-written rules: key, accepted range, value."""
    assert _problems(sets) == [message]


def test_suggestions_for_misspelt_keys_sections_and_choices(tmp_path):
    assert _problems(["grpo.lr_schedul=cosine"]) == ["grpo.lr_schedul: unknown key (did you mean grpo.lr_schedule?)"]
    assert _problems(["grpo.total_steps=3"]) == ["grpo.total_steps: unknown key (did you mean train.total_steps?)"]
    assert _problems(["modle.path=x"]) == ["modle: unknown section (did you mean model?)"]
    assert _problems(["grpo.loss_agg=token_mean"])[0].startswith(
        "grpo.loss_agg: 'token_mean' is not one of token-mean, seq-mean-token-mean, seq-mean-token-sum "
        "(did you mean token-mean")
    assert _problems(["xyz.a=1"]) == [
        "xyz: unknown section (known: model, data, reward, lora, grpo, train, rollout, router, sync, checkpoint, "
        "run, eval, env)"]
    with pytest.raises(C.ConfigError) as refused:
        _load(tmp_path, "grpo:\n  learning_rate: 1\nmodle:\n  path: x\nsync: 3\n")
    assert refused.value.problems == ["grpo.learning_rate: unknown key", "sync: must be a mapping of keys, got int 3",
                                      "modle: unknown section (did you mean model?)"]


def test_removed_key_says_what_replaced_it():
    assert _problems(["train.grad_accum=4"]) == [
        "train.grad_accum: unknown key (removed: steps are cut into micro-batches by train.max_tokens_per_micro_batch)"]


def test_bad_files(tmp_path):
    with pytest.raises(C.ConfigError, match="not found"):
        C.load(str(tmp_path / "missing.yaml"))
    with pytest.raises(C.ConfigError, match="not valid YAML"):
        _load(tmp_path, "grpo: [unclosed\n")
    with pytest.raises(C.ConfigError, match="top level must be a mapping"):
        _load(tmp_path, "- a\n- b\n")
    with pytest.raises(C.ConfigError, match="key=value"):
        C.load(None, ["grpo.lr"])
    with pytest.raises(C.ConfigError, match="keys are section.name"):
        C.load(None, ["lr=1"])


def test_several_problems_reported_together():
    """Every section's problems at once: field errors of several sections and a section rule of another."""
    assert _problems(["lora.rank=0", "train.zero_stage=9", "sync.every=4", "data.epochs=0"]) == [
        "data.epochs: must be >= 1, got 0", "lora.rank: must be > 0, got 0", "train.zero_stage: 9 is not one of "
        "0, 1, 2, 3", "sync.every: 4 publishes too rarely for sync.max_staleness 2: samples of the newest published "
        "version would already be stale; keep every <= 3 (max_staleness + 1)"]


def test_merge_fallback_reason():
    cfg = C.load(None, ["lora.use_dora=true"])
    assert "DoRA" in C.needs_merge(cfg)


def test_describe_lists_every_key_with_type_default_and_help():
    text = C.describe()
    for section_name, section in C.Config.model_fields.items():
        for name, info in section.annotation.model_fields.items():
            assert f"  {section_name}.{name} (" in text and info.description, (section_name, name)
    assert "  grpo.lr (float, default 0.001): AdamW learning rate" in text
    assert "train.profile_step (int or null, default None)" in text
    assert "  run.loggers (list of jsonl | tensorboard | mlflow | wandb, default ['jsonl'])" in text


def test_allowed_values_are_one_literal():
    """grpo.loss_agg and model.dtype: the Literal in common/config is what the validator accepts and what
    `train --help` prints; auto dtype is decided by resolve_dtype alone."""
    assert C.LOSS_AGGS == ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
    for agg in C.LOSS_AGGS:
        assert C.load(None, [f"grpo.loss_agg={agg}"]).grpo.loss_agg == agg
    assert "grpo.loss_agg (" + " | ".join(C.LOSS_AGGS) in C.describe()
    assert C.load(None, ["train.use_gpu=true"]).torch_dtype == C.resolve_dtype("auto", True) == "bfloat16"
    assert C.resolve_dtype("float16", False) == "float16"


def _literal_fields():
    for section_name, section in C.Config.model_fields.items():
        for name, info in section.annotation.model_fields.items():
            if typing.get_origin(info.annotation) is typing.Literal:
                yield f"{section_name}.{name}", typing.get_args(info.annotation)


@pytest.mark.parametrize("key, allowed", list(_literal_fields()))
def test_every_choice_is_checked_against_its_literal(key, allowed):
    """The validator accepts exactly a Literal's values, names them when refusing one, and `describe()`
    prints them; no choice is spelled out a second time."""
    for value in allowed:
        try:
            C.load(None, [f"{key}={value}"])
        except C.ConfigError as error:  # a value may break a rule of another key (liger_kernels=on needs a GPU)
            assert not any(p.startswith(f"{key}:") and "is not" in p for p in error.problems), error.problems
    problems = _problems([f"{key}=not-a-choice"])
    assert any(p.startswith(f"{key}: 'not-a-choice' is not") and all(str(v) in p for v in allowed)
               for p in problems), problems
    assert f"  {key} ({' | '.join(str(v) for v in allowed)}, default" in C.describe()


def test_literals_name_what_other_modules_build():
    assert typing.get_args(C.TinyShape) == tuple(SHAPES)
    assert C.VLLM_LORA_RANKS == (1, 8, 16, 32, 64, 128, 256, 320, 512)


def test_sections_state_their_own_rules():
    """A section's rules need only that section; defaults break none of them; building a section directly
    refuses what loading would, with the same messages."""
    for section in C.Config.model_fields.values():
        assert section.annotation().problems() == []
    with pytest.raises(C.ConfigError) as refused:
        C.SyncConfig(every=4, max_staleness=2)
    assert refused.value.problems[0].startswith("sync.every: 4 publishes too rarely")
    with pytest.raises(C.ConfigError) as refused:
        C.TrainConfig(profile_step=0, tracking=1)
    assert refused.value.problems == ["train.profile_step: must be >= 1 or null, got 0", "train.tracking: unknown key"]


def test_cross_section_rules():
    """lora.rank is bound by rollout.max_lora_rank only in adapter mode (merge mode pushes full weights); a
    section with a wrongly typed field skips the cross-section rules but the other sections' rules still run."""
    C.load(None, ["lora.rank=16", "rollout.max_lora_rank=8", "sync.mode=merge"])
    assert _problems(["grpo.max_new_tokens=600", "sync.every=0", "model.max_model_len=many"]) == [
        "model.max_model_len: expected int, got 'many'", "sync.every: must be >= 1, got 0"]


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
    with pytest.raises(C.ConfigError, match=r"grpo.min_lr_ratio: must be in \[0, 1\], got 1.5"):
        C.load(None, ["grpo.min_lr_ratio=1.5"])
    cfg = C.load(None, ["grpo.lr_schedule=cosine", "grpo.warmup_steps=4", "train.total_steps=14"])
    f = [lr_factor(cfg, s) for s in range(14)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0] and f[4] == 1.0 and abs(f[-1] - cfg.grpo.min_lr_ratio) < 1e-12
    assert all(a >= b for a, b in zip(f[4:], f[5:]))  # cosine only goes down
    assert {lr_factor(C.load(None, []), s) for s in range(10)} == {1.0}  # constant, no warmup: unchanged


def test_frozen_and_replace_builds_a_validated_copy():
    cfg = C.load(None, [])
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        cfg.sync.max_staleness = 5
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        cfg.sync = C.SyncConfig()
    changed = cfg.replace(rollout={"app_name": "other", "http_port": 9000}, sync=C.SyncConfig(max_staleness=4))
    assert (changed.rollout.app_name, changed.rollout.http_port, changed.sync.live_versions) == ("other", 9000, 5)
    assert cfg.rollout.app_name == "policy" and cfg.sync.max_staleness == 2  # the original is untouched
    assert cfg.data.replace(builtin_size=8).builtin_size == 8
    with pytest.raises(C.ConfigError, match=r"sync.max_staleness: must be >= 0, got -1"):
        cfg.replace(sync={"max_staleness": -1})
    with pytest.raises(C.ConfigError, match="lora.rank: 16 exceeds rollout.max_lora_rank 8"):
        cfg.replace(lora={"rank": 16})
    with pytest.raises(C.ConfigError, match="rolout: unknown section"):
        cfg.replace(rolout={"app_name": "x"})


def test_round_trips_to_workers():
    """Workers get the config as Config.to_dict() (Ray Train's train_loop_config, the torchrun JSON file) or
    pickled (Ray actors): both give back an equal, validated Config."""
    import json

    from train_loops.worker import WorkerOptions, loop_config, read_loop_config

    cfg = C.load("recipes/qwen2.5-math-1.5b-lora-r1.yaml", ["train.profile_step=2", "train.liger_kernels=off"])
    again = C.from_dict(cfg.to_dict())
    C.validate(again)
    assert again == cfg and again.to_dict() == cfg.to_dict()
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    back, _ = read_loop_config(json.loads(json.dumps(loop_config(cfg, WorkerOptions()))))
    assert back == cfg
    error = pickle.loads(pickle.dumps(C.ConfigError(["a.b: bad"])))
    assert error.problems == ["a.b: bad"]


def test_missing_tracker_package_is_refused_at_load(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    assert _problems(["run.loggers=[jsonl, mlflow]"]) == [
        "run.loggers: mlflow needs the `mlflow` package, which is not installed: pip install -e '.[tracking]' "
        "(or pip install mlflow)"]
    C.Config(run={"loggers": ["mlflow"]})  # building one does not look at this machine; load and validate do
    with pytest.raises(C.ConfigError, match="mlflow needs"):
        C.validate(C.Config(run={"loggers": ["mlflow"]}))
