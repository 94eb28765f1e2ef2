"""The embedded tiny model: a Qwen2-architecture causal LM with a character-level tokenizer and a chat
template, built deterministically from a seed, saved as an ordinary HF directory (so every loader in
the project treats it like any other model)."""
from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2's template, so prompts look like the real thing (and share a rendered prefix per system prompt).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_char(b: int) -> str:
    """GPT-2/Qwen byte-level alphabet: printable ASCII is itself, space is 'Ġ', newline 'Ċ'."""
    return chr(b) if 33 <= b <= 126 else chr(256 + b)


def _vocab() -> dict[str, int]:
    chars = [_byte_char(b) for b in list(range(33, 127)) + [32, 10]]  # printable ASCII, space, newline
    return {t: i for i, t in enumerate(SPECIALS + chars)}


def build_tokenizer():
    """Qwen2's own tokenizer class (byte-level BPE) with no merges: one token per character, so the
    tiny model's vocabulary stays ~100 and prompts are long enough in tokens to fill KV blocks."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    tok = Qwen2Tokenizer(vocab=_vocab(), merges=[], eos_token="<|im_end|>", pad_token="<|endoftext|>",
                         unk_token="<|endoftext|>", chat_template=CHAT_TEMPLATE, model_max_length=2048)
    tok.add_tokens([AddedToken(t, special=True) for t in SPECIALS])
    return tok


# `python -m app tiny-model --shape NAME`: the embedded model at three sizes.
SHAPES = {
    # The CPU main job's model: ~407k parameters, pretrained on CPU in seconds.
    "tiny": {"hidden": 128, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 384, "pretrain_steps": 200},
    # ~23M parameters for GPU runs that must learn: the same skill, pretrained in a minute or two on a GPU.
    "small": {"hidden": 512, "layers": 8, "heads": 8, "kv_heads": 2, "intermediate": 1408, "pretrain_steps": 600,
              "pretrain_lr": 1e-3, "dtype": "bfloat16"},
    # The Qwen2.5-1.5B body with its real vocabulary size, random weights: for speed work only.
    "qwen2.5-1.5b": {"hidden": 1536, "layers": 28, "heads": 12, "kv_heads": 2, "intermediate": 8960,
                     "vocab_size": 151_936, "pretrain_steps": 0, "init_std": 0.02, "dtype": "bfloat16",
                     "max_positions": 32768},
}


def build_model_shape(out: str | Path, shape: str = "tiny", seed: int = 0, **overrides) -> Path:
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r} (known: {', '.join(SHAPES)})")
    return build_tiny_model(out, seed=seed, **{**SHAPES[shape], **overrides}, shape=shape)


def build_tiny_model(out: str | Path, seed: int = 0, hidden: int = 128, layers: int = 2,
                     heads: int = 4, kv_heads: int = 2, intermediate: int = 384,
                     pretrain_steps: int = 200, pretrain_lr: float = 3e-3, vocab_size: int | None = None,
                     init_std: float | None = None, dtype: str = "float32", max_positions: int = 2048,
                     shape: str = "tiny") -> Path:
    """Write config, weights (safetensors, float32), tokenizer and generation config to `out`.

    Weights: random (embeddings N(0, 1), matrices N(0, 0.1 x sqrt(128 / hidden)): a large token signal
    lets so small a model learn to copy a token within a few hundred steps; `init_std` sets both, as
    for the random 1.5B body), then `pretrain_steps` of a generic skill (on a GPU when there is one):
    answer with one of the capital letters that appear in the user's message. That makes it a weak
    base model for the `letters` task (base success ~25%, like the 20-80% of real RL recipes): it knows
    to answer with a capital from the prompt, not which one the prompt names; GRPO teaches that.
    """
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    pad = tok.convert_tokens_to_ids("<|endoftext|>")
    if vocab_size is not None and vocab_size > len(tok):
        _pad_vocabulary(tok, vocab_size)
    cfg = Qwen2Config(
        vocab_size=vocab_size or len(tok), hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions, rope_theta=10000.0, tie_word_embeddings=True, eos_token_id=eos,
        pad_token_id=pad, bos_token_id=None, torch_dtype=dtype,
    )
    assert hidden // heads in (32, 64, 80, 96, 112, 128, 256), "vLLM CPU attention head sizes"
    device = "cuda" if pretrain_steps and torch.cuda.is_available() else "cpu"
    threads = torch.get_num_threads()
    if device == "cpu" and pretrain_steps:
        torch.set_num_threads(1)  # bit-reproducible reductions
    stats = {}
    try:
        gen = torch.Generator().manual_seed(seed)
        model = Qwen2ForCausalLM(cfg)
        mat_std = init_std if init_std is not None else 0.1 * (128 / hidden) ** 0.5
        emb_std = init_std if init_std is not None else 1.0
        with torch.no_grad():  # every tensor drawn from our generator: independent of HF's init order
            for name, p in sorted(model.named_parameters()):
                if p.ndim == 1:
                    p.fill_(1.0 if "norm" in name else 0.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * (emb_std if "embed" in name else mat_std))
        model.to(device)
        stats = _pretrain(model, tok, seed, pretrain_steps, lr=pretrain_lr)
    finally:
        torch.set_num_threads(threads)
    model.to(getattr(torch, dtype)).to("cpu").save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    GenerationConfig(eos_token_id=eos, pad_token_id=pad, do_sample=True).save_pretrained(out)
    (out / "TINY_MODEL.json").write_text(json.dumps({"seed": seed, "shape": shape, "params": model.num_parameters(),
                                                     "pretrain_steps": pretrain_steps, "pretrain_device": device,
                                                     **stats}))
    return out


def _pad_vocabulary(tok, size: int) -> None:
    """Fill the tokenizer up to the model's vocabulary with plain tokens (two-letter-plus words that
    byte-level BPE without merges never produces from text) so every id a model samples decodes."""
    import string

    letters = string.ascii_lowercase
    need = size - len(tok)
    words, k = [], 0
    while len(words) < need:
        n, w = k, ""
        while True:
            n, r = divmod(n, 26)
            w = letters[r] + w
            if n == 0:
                break
        words.append("Ġ~" + w)
        k += 1
    tok.add_tokens(words)


def _pretrain(model, tok, seed: int, steps: int, batch: int = 32, lr: float = 3e-3) -> dict:
    """Generic skill: reply with one capital letter that occurs in the user's message. Returns the
    mean loss of the first and last 10% of the steps."""
    import random
    import string

    import torch

    if not steps:
        return {}
    device = next(model.parameters()).device
    losses = []
    rng = random.Random(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    start_ids = tok("<|im_start|>assistant\n")["input_ids"]
    model.train()
    for _ in range(steps):
        texts = []
        for _ in range(batch):
            caps = rng.sample(string.ascii_uppercase, rng.randint(1, 4))
            words = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 6)))
                     for _ in range(rng.randint(2, 5))] + caps
            rng.shuffle(words)
            texts.append(tok.apply_chat_template(
                [{"role": "user", "content": " ".join(words)}, {"role": "assistant", "content": rng.choice(caps)}],
                tokenize=False))
        enc = tok(texts, return_tensors="pt", padding=True)
        labels = enc["input_ids"].clone()
        labels[enc["attention_mask"] == 0] = -100
        for i, ids in enumerate(enc["input_ids"].tolist()):  # learn only the assistant's reply
            labels[i, : _find(ids, start_ids) + len(start_ids)] = -100
        loss = model(**{k: v.to(device) for k, v in enc.items()}, labels=labels.to(device)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    k = max(1, steps // 10)
    return {"pretrain_loss_first": sum(losses[:k]) / k, "pretrain_loss_last": sum(losses[-k:]) / k}


def _find(ids: list[int], sub: list[int]) -> int:
    for i in range(len(ids) - len(sub), -1, -1):
        if ids[i:i + len(sub)] == sub:
            return i
    raise ValueError("assistant header not found")


def ensure_model(path: str | Path, build_tiny: bool = True, seed: int = 0, shape: str = "tiny") -> Path:
    """Return `path`; build the tiny model there first when it does not exist and building is allowed."""
    path = Path(path)
    if (path / "config.json").is_file():
        return path
    if not build_tiny:
        raise FileNotFoundError(
            f"model.path {path}: no config.json (set model.build_tiny=true to build the tiny model)"
        )
    return build_model_shape(path, shape, seed=seed)


def serve_config(model_dir, replicas: int = 1, max_staleness: int = 1, max_loras: int | None = None,
                 cpus_per_replica: float = 1.0, max_lora_rank: int = 8, **rollout):
    """A Config serving the model at `model_dir` on `replicas` CPU vLLM replicas (float32, 512-token context,
    16 sequences per engine): what the Serve tests and the serving benchmarks start. Extra keywords set
    `rollout.*` keys."""
    from common.config import Config

    return Config(model={"path": str(model_dir), "dtype": "float32", "max_model_len": 512},
                  rollout={"replicas": replicas, "cpus_per_replica": cpus_per_replica, "max_num_seqs": 16,
                           "max_lora_rank": max_lora_rank, **rollout},
                  sync={"max_staleness": max_staleness, "max_loras": max_loras})
