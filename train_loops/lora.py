"""Load a HF causal LM and wrap it in a PEFT LoRA adapter with the base frozen."""
from __future__ import annotations

import torch

from common.adapter_io import peft_config_to_dict
from common.config import Config, ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_base_model(path: str, dtype: str = "float32"):
    """Any AutoModelForCausalLM directory, in `dtype` (a Config.torch_dtype string)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation="sdpa")


def linear_module_names(model) -> list[str]:
    """Leaf names of the linear layers LoRA can target (the output head excluded, like PEFT's all-linear)."""
    head = model.get_output_embeddings()
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and m is not head})


def check_target_modules(model, target_modules) -> None:
    if target_modules == "all-linear":
        return
    valid = linear_module_names(model)
    unknown = [t for t in target_modules if t not in valid]
    if unknown:
        raise ConfigError([f"lora.target_modules: unknown module name(s) {unknown} for "
                           f"{type(model).__name__}; valid linear modules: {valid} (or `all-linear`)"])


def apply_lora(model, cfg: Config):
    """PEFT LoRA over `model` per cfg.lora; LoRA init seeded by train.seed so every rank starts equal."""
    from peft import LoraConfig, get_peft_model

    lo = cfg.lora
    check_target_modules(model, lo.target_modules)
    peft_cfg = LoraConfig(r=lo.rank, lora_alpha=lo.alpha, lora_dropout=lo.dropout,
                          target_modules=lo.target_modules, use_dora=lo.use_dora,
                          modules_to_save=list(lo.modules_to_save) or None, task_type="CAUSAL_LM", bias="none")
    if cfg.train.fused_lora:
        from train_loops.lora_linear import register

        register(peft_cfg)
    torch.manual_seed(cfg.train.seed)
    pm = get_peft_model(model, peft_cfg)
    for name, p in pm.named_parameters():
        if "lora_" not in name and "modules_to_save" not in name:
            p.requires_grad_(False)
    return pm


def build_lora_model(cfg: Config, model_path: str | None = None):
    """The trainer's model: base from cfg.model.path (in `Config.trainer_dtype`), LoRA applied."""
    model = load_base_model(model_path or cfg.model.path, cfg.trainer_dtype)
    from train_loops.fused_kernels import apply_liger

    model.liger_kernels = apply_liger(model, cfg, on_gpu=cfg.train.use_gpu and torch.cuda.is_available())
    if cfg.train.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    return apply_lora(model, cfg)


def peft_config_dict(peft_model) -> dict:
    return peft_config_to_dict(peft_model.peft_config["default"])
