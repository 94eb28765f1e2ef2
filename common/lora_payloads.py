"""Payloads of a model in the form the trainer publishes them, made without a trainer: a LoRA adapter with
random non-zero B (so it visibly changes outputs) and the merged full weights, plus the PEFT model a payload
gives (the reference an engine's outputs are compared with). The Serve tests and the serving benchmarks
publish these into a real AdapterRegistry."""
from __future__ import annotations

# PEFT target modules: all 7 projections of a Qwen2 block.
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def base_model(model_dir):
    """The HF model at `model_dir`, float32, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def make_lora_payload(model_dir, seed: int, rank: int = 8, alpha: float = 16.0, b_std: float = 0.3,
                      targets=TARGETS) -> tuple[dict, dict]:
    """A PEFT LoRA state dict with random non-zero A and B, and its publish metadata: the (tensors, meta)
    pair the trainer publishes."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    from common.adapter_io import make_meta, peft_config_to_dict

    torch.manual_seed(seed)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0)
    model = get_peft_model(base_model(model_dir), cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * b_std)
    tensors = {k: v.detach().clone().contiguous() for k, v in get_peft_model_state_dict(model).items()}
    pc = peft_config_to_dict(model.peft_config["default"])
    pc["base_model_name_or_path"] = str(model_dir)
    return tensors, make_meta(tensors, pc, kind="adapter")


def peft_model(model_dir, tensors: dict, meta: dict):
    """The base model with a LoRA payload applied through PEFT."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    pc = {k: v for k, v in meta["peft_config"].items() if k in LoraConfig.__dataclass_fields__}
    model = get_peft_model(base_model(model_dir), LoraConfig(**pc))
    res = set_peft_model_state_dict(model, tensors)
    bad = [k for k in res.unexpected_keys if "lora" in k]
    if bad:
        raise ValueError(f"LoRA tensors PEFT did not take: {bad[:3]}")
    return model.eval()


def make_merged_payload(model_dir, tensors: dict, meta: dict) -> tuple[dict, dict]:
    """A LoRA payload folded into the base weights (what merge mode publishes): full HF-named tensors."""
    from common.adapter_io import make_meta

    model = peft_model(model_dir, tensors, meta).merge_and_unload()
    full = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        full.pop("lm_head.weight", None)  # tied: the embedding carries it
    return full, make_meta(full, None, kind="merged")


def prompt_ids(model_dir, text: str) -> list[int]:
    """`text` as a user turn under the model's chat template, ready for generation."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False)
