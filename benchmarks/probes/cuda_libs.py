"""Probe: which CUDA libraries torch loads on this machine, and whether each works: a bf16 matmul (cuBLAS), an NCCL
all-reduce on one rank (what DeepSpeed's one-GPU trainer initialises), and the versions torch reports for NCCL,
cuDNN and cuSPARSELt beside the paths it mapped.

    python -m benchmarks.probes.cuda_libs OUT.json

Why: the offline bundle brings cuBLAS, cuSPARSELt and NCCL (~760 MB of its 2,361 MiB, 16 of its 48 parts) because
torch 2.13 pins patch or minor versions the image lacks (cuBLAS 13.1.1 vs the image's 13.1.0, cuSPARSELt 0.8.1 vs
0.8.0, NCCL 2.29.7 vs 2.28.9). A bundle built with those three named in `--target-has` is 1,588 MiB in 32 parts; run
on it, this probe says whether the image's libraries do (docs/GPU.md, "Offline install"). cuDNN stays in the bundle:
torch refuses a runtime cuDNN of a lower minor than it was built with."""
from __future__ import annotations

import json
import sys


def _version(fn) -> str:
    try:
        return str(fn())
    except Exception as e:  # a library that fails to load is the answer, not a crash
        return f"error {type(e).__name__}: {e}"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        print("cuda_libs: no GPU here; this probe checks the CUDA libraries torch loads", file=sys.stderr)
        return 2
    out: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0),
                 "nccl_version": _version(torch.cuda.nccl.version),
                 "cudnn_version": _version(torch.backends.cudnn.version),
                 "cusparselt_version": _version(torch.backends.cusparselt.version)}
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    out["matmul_ok"] = bool(torch.isfinite(a @ a).all())
    try:
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29555", rank=0, world_size=1)
        t = torch.ones(4, device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        out["nccl_all_reduce_ok"] = t.tolist() == [1.0] * 4
        dist.destroy_process_group()
    except Exception as e:
        out["nccl_all_reduce_ok"] = False
        out["nccl_error"] = f"{type(e).__name__}: {e}"
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if len(line.split()) >= 6}
    libs = ("libcublas", "libnccl", "libcusparseLt", "libcudnn.so")
    out["loaded"] = sorted(p for p in paths if any(k in p for k in libs))
    out["ok"] = out["matmul_ok"] and out["nccl_all_reduce_ok"]
    print(json.dumps(out, indent=1))
    with open(args[0], "w") as f:
        json.dump(out, f, indent=1)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
