"""The per-worker loop under torchrun (2 processes, gloo, real DeepSpeed + PEFT): only LoRA moves,
resume is bit-identical, the PEFT export reproduces the trainer's logits."""
import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _train_helpers import read_steps, run_torchrun, small_config, tiny_model  # noqa: E402

from common.config import ConfigError  # noqa: E402
from train_loops.harness import HarnessOptions  # noqa: E402

COMPILE_LINES = re.compile(r"ninja|Building extension|built successfully|Emitting ninja", re.I)


def load(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def hf_name(peft_name: str) -> str:
    return peft_name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def initial_lora(cfg) -> dict:
    from train_loops.lora import build_lora_model

    return {n: p.detach().clone() for n, p in build_lora_model(cfg).named_parameters() if "lora_" in n}


def assert_only_lora_changed(full: dict, model_dir: Path, cfg) -> None:
    base = load(model_dir / "model.safetensors")
    frozen = {hf_name(n): t for n, t in full.items() if "lora_" not in n}
    assert set(base) <= set(frozen), set(base) - set(frozen)
    for name, t in base.items():
        assert torch.equal(frozen[name], t), f"base weight {name} changed"
    init = initial_lora(cfg)
    assert set(init) == {n for n in full if "lora_" in n}
    moved = [n for n in init if not torch.equal(init[n], full[n])]
    assert len(moved) == len(init), f"LoRA tensors that did not move: {set(init) - set(moved)}"


@pytest.fixture(scope="module")
def zero2_run(tmp_path_factory):
    """4 straight steps, ZeRO-2, checkpoints at 2 and 4; a warmup + cosine lr schedule, so a resume that lost the
    schedule's place would train steps 3-4 at other rates."""
    root = tmp_path_factory.mktemp("z2")
    model = tiny_model()
    cfg = small_config(model, train={"total_steps": 4, "zero_stage": 2}, checkpoint={"every": 2},
                       grpo={"lr_schedule": "cosine", "warmup_steps": 2, "min_lr_ratio": 0.1})
    out = run_torchrun(cfg, HarnessOptions(checkpoint_dir=str(root / "ck"),
                                          record_dir=str(root / "dump")), root)
    return root, model, cfg, out


@pytest.mark.slow
def test_zero2_only_lora_params_change(zero2_run):
    root, model, cfg, out = zero2_run
    assert not COMPILE_LINES.search(out), "DeepSpeed compiled an op on CPU"
    assert_only_lora_changed(load(root / "dump" / "full_state.safetensors"), model, cfg)
    steps = read_steps(root / "dump")
    assert [s["version"] for s in steps] == [1, 2, 3, 4]
    # warmup 0.5, 1; cosine from 1 down to min_lr_ratio at the last step
    assert [round(s["lr"] / cfg.grpo.lr, 6) for s in steps] == [0.5, 1.0, 1.0, 0.1]
    for key in ("loss", "clip_frac", "entropy", "grad_norm", "log_ratio_abs_mean", "log_ratio_abs_max",
                "train_tokens_per_s", "publish_seconds", "adapter_bytes", "reward_mean", "reward_std"):
        assert key in steps[0], key


@pytest.mark.slow
def test_resume_is_bit_identical(zero2_run):
    root, model, cfg, _ = zero2_run
    run_torchrun(cfg, HarnessOptions(checkpoint_dir=str(root / "ck2"),
                                    record_dir=str(root / "dump2"),
                                    resume_from=str(root / "ck" / "checkpoint_000002")), root)
    straight = load(root / "ck" / "checkpoint_000004" / "adapter" / "adapter_model.safetensors")
    resumed = load(root / "ck2" / "checkpoint_000004" / "adapter" / "adapter_model.safetensors")
    assert straight.keys() == resumed.keys()
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), k
    a, b = load(root / "dump" / "full_state.safetensors"), load(root / "dump2" / "full_state.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [s["step"] for s in read_steps(root / "dump2")] == [3, 4]
    assert [s["version"] for s in read_steps(root / "dump2")] == [3, 4]
    assert [s["lr"] for s in read_steps(root / "dump2")] == [s["lr"] for s in read_steps(root / "dump")][2:]
    assert (read_steps(root / "dump2")[-1]["loss"] == read_steps(root / "dump")[-1]["loss"])


@pytest.mark.slow
def test_peft_export_reloads_with_the_trainers_logits(zero2_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from train_loops.lora import build_lora_model

    root, model, cfg, _ = zero2_run
    trainer = build_lora_model(cfg)
    res = trainer.load_state_dict(load(root / "dump" / "full_state.safetensors"), strict=False)
    assert res.missing_keys == ["base_model.model.lm_head.weight"] and not res.unexpected_keys  # tied to embeddings
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(base, root / "ck" / "checkpoint_000004" / "adapter")
    ids = torch.randint(3, 99, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = trainer(ids).logits, reloaded(ids).logits
    assert torch.allclose(want, got, atol=1e-6)
    with torch.no_grad(), reloaded.disable_adapter():
        assert not torch.allclose(reloaded(ids).logits, got, atol=1e-4)  # the adapter does something


@pytest.mark.slow
def test_zero3_kl_tis_micro_batches_only_lora_changes_and_resumes(tmp_path):
    model = tiny_model()
    # 32-token budget over <= 24-token sequences: one or two sequences per micro-batch, several per step
    cfg = small_config(model, model={"max_model_len": 32},
                       train={"zero_stage": 3, "max_tokens_per_micro_batch": 32, "total_steps": 2},
                       checkpoint={"every": 1},
                       grpo={"kl_coef": 0.1, "tis_cap": 2.0, "loss_agg": "seq-mean-token-sum"},
                       lora={"target_modules": ["q_proj", "v_proj", "up_proj"]})
    # persistence threshold 0: really partition even the tiny model's small tensors
    options = HarnessOptions(checkpoint_dir=str(tmp_path / "ck"),
                            record_dir=str(tmp_path / "dump"),
                            ds_overrides={"zero_optimization": {"stage3_param_persistence_threshold": 0}})
    out = run_torchrun(cfg, options, tmp_path)
    assert not COMPILE_LINES.search(out), "DeepSpeed compiled an op on CPU"
    full = load(tmp_path / "dump" / "full_state.safetensors")
    assert_only_lora_changed(full, model, cfg)
    steps = read_steps(tmp_path / "dump")
    assert steps[-1]["kl"] > 0 and "tis_weight_mean" in steps[-1]
    assert steps[-1]["micro_batches"] >= 4  # 8 sequences per rank
    adapter = load(tmp_path / "ck" / "checkpoint_000002" / "adapter" / "adapter_model.safetensors")
    for k, v in adapter.items():  # the gathered export equals the live (gathered) weights
        assert torch.equal(v, full[k.replace(".weight", ".default.weight")]), k
    # resume under ZeRO-3 (partitioned LoRA + optimizer shards) is bit-identical too
    run_torchrun(cfg, replace(options, checkpoint_dir=str(tmp_path / "ck2"), record_dir=str(tmp_path / "dump2"),
                              resume_from=str(tmp_path / "ck" / "checkpoint_000001")), tmp_path)
    resumed = load(tmp_path / "ck2" / "checkpoint_000002" / "adapter" / "adapter_model.safetensors")
    assert all(torch.equal(adapter[k], resumed[k]) for k in adapter)


def test_trainer_dtype_apart_from_the_engines():
    """train.dtype float32 under a bfloat16 model: the engines keep bf16, the trainer's weights, DeepSpeed's
    config and its memory budget are fp32 (the trainer scores the engine's samples against the fp32 model)."""
    from serve_deployments.engine_config import engine_kwargs
    from train_loops.deepspeed_setup import ds_config
    from train_loops.lora import build_lora_model

    cfg = small_config(tiny_model(), model={"dtype": "bfloat16"}, train={"dtype": "float32"})
    assert (cfg.torch_dtype, cfg.trainer_dtype) == ("bfloat16", "float32")
    assert engine_kwargs(cfg)["dtype"] == "bfloat16"
    ds = ds_config(cfg, world_size=1)
    assert not ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    assert {p.dtype for p in build_lora_model(cfg).parameters()} == {torch.float32}
    same = small_config(tiny_model(), model={"dtype": "bfloat16"})  # auto: the engines' dtype
    assert same.trainer_dtype == "bfloat16" and ds_config(same, world_size=1)["bf16"]["enabled"]


def test_unknown_target_module_is_a_clear_config_error(tmp_path):
    from train_loops.lora import build_lora_model

    cfg = small_config(tiny_model(), lora={"target_modules": ["q_proj", "qkv_proj"]})
    with pytest.raises(ConfigError) as e:
        build_lora_model(cfg)
    msg = str(e.value)
    assert "lora.target_modules" in msg and "'qkv_proj'" in msg
    for valid in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert valid in msg
    assert "lm_head" not in msg


def test_publisher_versions_follow_steps_delta_tags_and_every():
    """Single process (no process group): the skip decision is the local max |change|. The version
    advances with every optimizer step; off-grid steps publish nothing, unmoved adapters are tagged."""
    from train_loops.adapter_sync import AdapterPublisher
    from train_loops.lora import build_lora_model, peft_config_dict

    cfg = small_config(tiny_model())
    pm = build_lora_model(cfg)
    pub = AdapterPublisher(rank=0, zero_stage=2, mode="adapter", every=2, delta_threshold=1e-2,
                           peft_config=peft_config_dict(pm), registry_name=None, device=torch.device("cpu"))
    one = pub.maybe_publish(pm, 1)  # not a sync step
    assert (one["published"], one["aliased"], one["version"], one["served_version"]) == (0, 0, 1, 0)
    first = pub.maybe_publish(pm, 2)
    assert first["published"] == 1 and first["version"] == 2 and first["adapter_bytes"] > 0
    lora_b = next(p for n, p in pm.named_parameters() if "lora_B" in n)
    with torch.no_grad():
        lora_b[0, 0] += 5e-3  # below the threshold
    assert pub.maybe_publish(pm, 3)["version"] == 3
    tagged = pub.maybe_publish(pm, 4)
    assert (tagged["published"], tagged["aliased"], tagged["version"], tagged["served_version"]) == (0, 1, 4, 4)
    with torch.no_grad():
        lora_b[0, 0] += 1e-2  # 1.5e-2 since the last publish
    pub.maybe_publish(pm, 5)
    again = pub.maybe_publish(pm, 6)
    assert again["published"] == 1 and again["version"] == 6 and again["served_version"] == 6
    assert again["max_delta"] == pytest.approx(1.5e-2, rel=1e-3)


def test_overlapped_publish_keeps_order_and_reports_errors_late():
    """sync.overlap_publish: rank 0 hands versions to a real AdapterRegistry actor (no replicas
    attached) on a background thread. Versions arrive in order, tags after the publish they alias,
    every version is held after flush(), and a registry refusal surfaces at the next publish."""
    import ray

    from common.names import NAMESPACE
    from common.registry import AdapterRegistry
    from train_loops.adapter_sync import AdapterPublisher
    from train_loops.lora import build_lora_model, peft_config_dict

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        made = AdapterRegistry.options(name="overlap-registry", namespace=NAMESPACE).remote(keep=8)
        assert ray.get(made.live_versions.remote()) == []  # registered before the publisher looks it up
        cfg = small_config(tiny_model())
        pm = build_lora_model(cfg)
        pub = AdapterPublisher(rank=0, zero_stage=2, mode="adapter", every=1, delta_threshold=0.0,
                               peft_config=peft_config_dict(pm), registry_name="overlap-registry",
                               device=torch.device("cpu"), overlap=True, on_served=lambda v: served.append(v))
        served = []  # what the buffer's pacing is told: each version once the registry serves it
        registry = pub.registry
        lora_b = next(p for n, p in pm.named_parameters() if "lora_B" in n)
        rows = []
        for step in range(1, 6):
            if step != 3:  # step 3 leaves the adapter as it was: a tag of version 2
                with torch.no_grad():
                    lora_b[0, 0] += 0.1
            rows.append(pub.maybe_publish(pm, step))
        # A row reports the registry call that finished while it waited: the previous version's.
        assert "publish_to_served_seconds" not in rows[0]
        assert all(r["publish_to_served_seconds"] >= 0 and r["publish_blocked_seconds"] >= 0 for r in rows[1:])
        assert [r["published"] for r in rows] == [1, 1, 0, 1, 1] and rows[2]["aliased"] == 1
        assert all(r["served_pending"] == 1 for r in rows)  # the worker tells the buffer "not ready yet"
        done = pub.flush()
        assert served == [1, 2, 3, 4, 5]
        assert done["publish_to_served_seconds"] >= 0
        # the registry refuses a version not newer than its live ones: all five live means they came in order
        assert ray.get(registry.live_versions.remote()) == [1, 2, 3, 4, 5]
        assert ray.get(registry.get.remote(3))["meta"]["alias_of"] == 2

        pub.version = 2  # a version the registry already holds: refused, reported at the next call
        with torch.no_grad():
            lora_b[0, 0] += 0.1
        pub.maybe_publish(pm, 6)  # submitted; the refusal happens in the background
        with pytest.raises(ValueError, match="already published"):
            pub.flush()
    finally:
        ray.shutdown()
