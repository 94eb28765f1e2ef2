"""The CLI fails bad input before anything starts: one clear message naming the key, exit code 2,
and no Ray instance (so nothing trained or served is touched)."""
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parent.parent


def _app(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "app", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def test_help_lists_commands_and_keys():
    top = _app("--help")
    assert top.returncode == 0 and all(c in top.stdout for c in ("train", "serve", "merge", "tiny-model", "bench"))
    train = _app("train", "--help")
    assert train.returncode == 0 and "grpo.group_size" in train.stdout and "sync.max_staleness" in train.stdout


@pytest.mark.parametrize("sets, key", [
    (["lora.rank=0"], "lora.rank"),
    (["train.zero_stage=5"], "train.zero_stage"),
    (["sync.max_staleness=3", "sync.max_loras=2"], "sync.max_loras"),
    (["grpo.group_size=1"], "grpo.group_size"),
])
def test_invalid_config_fails_before_ray(sets, key):
    p = _app("train", "--config", "recipes/tiny-cpu.yaml", *[a for s in sets for a in ("--set", s)])
    assert p.returncode == 2, p.stderr[-2000:]
    assert key in p.stderr
    assert "Started a local Ray instance" not in p.stdout + p.stderr


def test_missing_column_and_unknown_module_fail_before_ray(tmp_path, tiny_model_dir):
    data = tmp_path / "d.parquet"
    pq.write_table(pa.table({"question": ["a"], "answer": ["b"]}), data)
    p = _app("train", "--config", "recipes/tiny-cpu.yaml", "--set", f"model.path={tiny_model_dir}",
             "--set", f"data.path={data}")
    assert p.returncode == 2 and "data.prompt_column" in p.stderr and "question" in p.stderr
    assert "Started a local Ray instance" not in p.stdout + p.stderr
    p = _app("train", "--config", "recipes/tiny-cpu.yaml", "--set", f"model.path={tiny_model_dir}",
             "--set", "lora.target_modules=[q_proj, attn_out]")
    assert p.returncode == 2 and "lora.target_modules" in p.stderr and "attn_out" in p.stderr
    assert "Started a local Ray instance" not in p.stdout + p.stderr
