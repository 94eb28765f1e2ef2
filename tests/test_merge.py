"""merge_adapter against PEFT's own merge_and_unload, on single-file and sharded bases."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _train_helpers import tiny_model  # noqa: E402

from common.adapter_io import AdapterError, read_peft_dir, write_peft_dir  # noqa: E402
from train_loops.merge import load_base_state, lora_pairs, main, merge_adapter, merged_state  # noqa: E402


@pytest.fixture(scope="module")
def base_and_adapter(tmp_path_factory):
    """The tiny model and a rank-4 adapter with random (non-zero) A and B on q_proj, v_proj, down_proj."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("merge")
    base = tiny_model()
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    pm = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                          init_lora_weights=False))
    pm.save_pretrained(root / "adapter")
    return base, root / "adapter", root


def peft_merged(base, adapter) -> dict:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return PeftModel.from_pretrained(model, adapter).merge_and_unload().state_dict()


def assert_matches(out_dir: Path, want: dict):
    got = load_base_state(out_dir)
    for name, w in want.items():
        if name in got:
            assert torch.allclose(got[name], w, atol=1e-5), name
    assert set(got) <= set(want)
    assert (out_dir / "config.json").is_file() and (out_dir / "tokenizer_config.json").is_file()


def test_merge_equals_peft_merge_and_unload(base_and_adapter):
    base, adapter, root = base_and_adapter
    want = peft_merged(base, adapter)
    out = merge_adapter(base, adapter, root / "merged")
    assert_matches(out, want)
    assert not torch.equal(load_base_state(out)["model.layers.0.self_attn.q_proj.weight"],
                           load_base_state(base)["model.layers.0.self_attn.q_proj.weight"])
    # the in-memory variant (merge-mode publish) gives the same tensors
    tensors, cfg = read_peft_dir(adapter)
    mem = merged_state(load_base_state(base), lora_pairs(tensors, cfg))
    for k, v in load_base_state(out).items():
        assert torch.equal(mem[k], v), k


def test_merge_sharded_base(base_and_adapter):
    from transformers import AutoModelForCausalLM

    base, adapter, root = base_and_adapter
    sharded = root / "sharded"
    AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).save_pretrained(sharded, max_shard_size="200KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (sharded / f).write_bytes((base / f).read_bytes())
    assert (sharded / "model.safetensors.index.json").is_file()
    out = merge_adapter(sharded, adapter, root / "merged-sharded")
    assert (out / "model.safetensors.index.json").is_file()
    assert len(list(out.glob("model-*.safetensors"))) > 1
    assert_matches(out, peft_merged(base, adapter))


def test_unpaired_adapter_tensor_is_named(base_and_adapter, capsys):
    base, adapter, root = base_and_adapter
    tensors, cfg = read_peft_dir(adapter)
    bogus = "base_model.model.model.layers.7.mlp.up_proj"
    tensors[f"{bogus}.lora_A.weight"] = torch.zeros(4, 128)
    tensors[f"{bogus}.lora_B.weight"] = torch.zeros(384, 4)
    write_peft_dir(tensors, cfg, root / "bad-adapter")
    with pytest.raises(AdapterError, match=r"layers\.7\.mlp\.up_proj"):
        merge_adapter(base, root / "bad-adapter", root / "bad-out")
    assert not (root / "bad-out").exists()  # nothing written before the check
    assert main(["--base", str(base), "--adapter", str(root / "bad-adapter"), "--out", str(root / "x")]) == 1
    assert "layers.7.mlp.up_proj" in capsys.readouterr().err


def test_lone_lora_a_is_an_error(base_and_adapter):
    base, adapter, root = base_and_adapter
    tensors, cfg = read_peft_dir(adapter)
    tensors.pop("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight")
    with pytest.raises(AdapterError, match=r"layers\.0\.self_attn\.q_proj.*lora_B"):
        lora_pairs(tensors, cfg)


def test_main_cli(base_and_adapter, capsys):
    base, adapter, root = base_and_adapter
    assert main(["--base", str(base), "--adapter", str(adapter), "--out", str(root / "cli")]) == 0
    assert (root / "cli" / "model.safetensors").is_file()
