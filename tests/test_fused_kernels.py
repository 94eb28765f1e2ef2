"""train.liger_kernels on CPU (Liger's kernels are Triton, GPU only; their speed and numerics are checked
on the GPU machine by benchmarks/gpu_pipeline.py's trainer phase and its ablation): auto leaves a CPU
model untouched and says why; `on` without use_gpu is a config error naming the key."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _train_helpers import small_config, tiny_model  # noqa: E402


def test_auto_on_cpu_patches_nothing():
    from transformers import AutoModelForCausalLM

    from train_loops.fused_kernels import apply_liger, liger_applied

    cfg = small_config(tiny_model())
    m = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    forwards = {n: type(mod).forward for n, mod in m.named_modules()}
    assert apply_liger(m, cfg, on_gpu=False) == "off (CPU)"
    assert all("forward" not in vars(mod) for mod in m.modules())  # no instance-bound forward
    assert forwards == {n: type(mod).forward for n, mod in m.named_modules()}
    cfg = cfg.replace(train={"liger_kernels": "off"})
    assert apply_liger(m, cfg, on_gpu=True) == "off"
    # the budget's estimate follows the status: nothing patched here, so HF's layers are counted
    assert not liger_applied(apply_liger(m, cfg, on_gpu=True)) and not liger_applied("off (CPU)")


def test_on_and_off_survive_yaml_booleans(tmp_path):
    from common import config as C

    assert C.load("recipes/tiny-cpu.yaml", ["train.liger_kernels=off"]).train.liger_kernels == "off"
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  liger_kernels: off\n  use_gpu: true\n")
    assert C.load(str(f)).train.liger_kernels == "off"
    assert C.load(str(f), ["train.liger_kernels=on"]).train.liger_kernels == "on"


def test_on_needs_a_gpu():
    from common.config import ConfigError

    with pytest.raises(ConfigError, match="train.liger_kernels: on needs train.use_gpu"):
        small_config(tiny_model(), train={"liger_kernels": "on"})
    with pytest.raises(ConfigError, match="liger_kernels"):
        small_config(tiny_model(), train={"liger_kernels": "sometimes"})
