"""`python -m app import-gguf`: a tiny Qwen2 GGUF written here with the `gguf` package (random weights, half
of them Q8_0-quantized, the embedded tiny model's character vocabulary and chat template) is imported, and
the imported directory gives exactly the logits and token ids of transformers' own GGUF load."""
import hashlib

import numpy as np
import pytest
import torch

from app.import_gguf import GGUFImportError, import_gguf
from app.tiny_model import CHAT_TEMPLATE, SPECIALS, _vocab

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128


def write_tiny_gguf(path):
    import gguf

    rng = np.random.default_rng(0)
    tokens = list(_vocab()) + ["he"]  # one merged token, so the file has merges (an empty array cannot be written)
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name("tiny-gguf-test")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(["h e"])
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_chat_template(CHAT_TEMPLATE)

    def tensor(name, *shape, quantize=False, scale=0.1):
        x = (rng.standard_normal(shape) * scale).astype(np.float32)
        if quantize:  # stored as Q8_0 blocks: the import has to dequantize them like transformers does
            w.add_tensor(name, gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, x)

    kv = HIDDEN // HEADS * KV_HEADS
    tensor("token_embd.weight", len(tokens), HIDDEN, quantize=True)
    for i in range(LAYERS):
        b = f"blk.{i}."
        tensor(b + "attn_norm.weight", HIDDEN, scale=1.0)
        tensor(b + "attn_q.weight", HIDDEN, HIDDEN, quantize=True)
        tensor(b + "attn_q.bias", HIDDEN)
        tensor(b + "attn_k.weight", kv, HIDDEN, quantize=True)
        tensor(b + "attn_k.bias", kv)
        tensor(b + "attn_v.weight", kv, HIDDEN)
        tensor(b + "attn_v.bias", kv)
        tensor(b + "attn_output.weight", HIDDEN, HIDDEN)
        tensor(b + "ffn_norm.weight", HIDDEN, scale=1.0)
        tensor(b + "ffn_gate.weight", FFN, HIDDEN, quantize=True)
        tensor(b + "ffn_up.weight", FFN, HIDDEN)
        tensor(b + "ffn_down.weight", HIDDEN, FFN, quantize=True)
    tensor("output_norm.weight", HIDDEN, scale=1.0)
    tensor("output.weight", len(tokens), HIDDEN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    path = write_tiny_gguf(d / "tiny-q8.gguf")
    sums = d / "SHA256SUMS"
    sums.write_text(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.name}\n")
    return path, sums


def test_import_gives_transformers_own_gguf_logits(tiny_gguf, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, sums = tiny_gguf
    info = import_gguf(path, tmp_path / "model", sha256sums=sums, dtype="float32")
    assert info["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert info["architecture"] == "qwen2" and info["chat_template"] == "file"
    assert {"model.safetensors", "config.json", "tokenizer.json", "generation_config.json"} <= set(info["files"])
    assert not (tmp_path / "model" / "config.json").read_text().count("quantization_config")

    ref_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tok = AutoTokenizer.from_pretrained(tmp_path / "model")
    msgs = [{"role": "user", "content": "Say the letter K, not Q or Z. he"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert tok.chat_template == CHAT_TEMPLATE and text.startswith("<|im_start|>user\n")  # the file's template
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == ref_tok(text, add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids).count("he") == text.count("he") == 2  # the merge survived
    assert tok.convert_tokens_to_ids("<|im_end|>") in ids  # specials stay whole

    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        ref_logits, got_logits = ref(x).logits, got(x).logits
    assert got_logits.dtype == torch.float32 and ref_logits.std() > 0.05  # random weights: logits that differ
    torch.testing.assert_close(got_logits, ref_logits, rtol=0, atol=0)

    # bfloat16 (the default, what the GPU recipe trains in): the same as transformers' own bf16 load
    import_gguf(path, tmp_path / "bf16")
    ref16 = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.bfloat16).eval()
    got16 = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").eval()
    assert got16.dtype == torch.bfloat16
    with torch.no_grad():
        torch.testing.assert_close(got16(x).logits, ref16(x).logits, rtol=0, atol=0)


def test_checksum_mismatch_is_a_clear_error(tiny_gguf, tmp_path, capsys):
    from app.__main__ import main

    path, _ = tiny_gguf
    bad = tmp_path / "SHA256SUMS"
    bad.write_text(f"{'0' * 64}  {path.name}\n")
    with pytest.raises(GGUFImportError, match=rf"checksum mismatch: {path}.*{bad}"):
        import_gguf(path, tmp_path / "out", sha256sums=bad)
    assert not (tmp_path / "out").exists()  # nothing loaded or written
    other = tmp_path / "OTHER"
    other.write_text(f"{'0' * 64}  another.gguf\n")
    with pytest.raises(GGUFImportError, match="lists no checksum for tiny-q8.gguf"):
        import_gguf(path, tmp_path / "out", sha256sums=other)
    assert main(["import-gguf", str(path), "--sha256sums", str(bad), "--out", str(tmp_path / "out")]) == 2
    assert "error: checksum mismatch" in capsys.readouterr().err


def test_a_tokenizer_that_splits_its_own_words_is_refused():
    """transformers 5.17 turned Gemma 3's GGUF vocabulary into per-character pieces: the import must say so,
    not write a model that reads text it never saw. A real `tokenizers` BPE without its merges does the same."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from app.import_gguf import GGUFImportError, check_tokenizer

    words = ["\u2581hello", "\u2581world", "\u2581answer", "\u2581boxed", "\u2581pears"]
    chars = sorted({c for w in words for c in w})
    vocab = {t: i for i, t in enumerate(["<unk>", *words, *chars])}

    def fast(merges):
        tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
        tk.pre_tokenizer = pre_tokenizers.Metaspace()
        tk.decoder = decoders.Metaspace()
        return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>")

    with pytest.raises(GGUFImportError, match=r"splits 5 of 5 whole-word tokens.*--tokenizer DIR"):
        check_tokenizer(fast([]), "broken.gguf")
    merges, seen = [], set()
    for w in words:  # left-to-right merges build each word back
        for i in range(2, len(w) + 1):
            pair = (w[:i - 1], w[i - 1])
            if pair not in seen:
                seen.add(pair)
                merges.append(pair)
                vocab.setdefault(w[:i], len(vocab))
    check_tokenizer(fast(merges), "good.gguf")
