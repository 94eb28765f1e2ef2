"""Probe (CPU or GPU host): what a publish's object-store hops cost for the 1.5B shape's rank-1 all-linear
adapter (392 tensors, 2.3 MB), as a dict of tensors against one safetensors buffer (pack_tensors):
the trainer's put plus a registry actor that takes the payload and re-puts it (what AdapterRegistry.publish
does), then a replica's get and unpack. Median of 7; writes OUT_JSON.
    python -m benchmarks.probes.payload_transport [OUT_JSON]"""
import json
import statistics
import time
from pathlib import Path

import ray
import torch

from common.adapter_io import pack_tensors, unpack_tensors

# Qwen2.5-1.5B: hidden 1536, intermediate 8960, 2 KV heads of 128; the 7 linears of each of 28 layers.
LINEARS = {"q_proj": (1536, 1536), "k_proj": (1536, 256), "v_proj": (1536, 256), "o_proj": (1536, 1536),
           "gate_proj": (1536, 8960), "up_proj": (1536, 8960), "down_proj": (8960, 1536)}


@ray.remote
class Registry:
    def take(self, payload):
        ray.put(payload)  # the registry owns its copy (it outlives the trainer)
        return True


def main(out: str | None) -> dict:
    tensors = {}
    for layer in range(28):
        for mod, (fan_in, fan_out) in LINEARS.items():
            base = f"base_model.model.model.layers.{layer}.mlp.{mod}"
            tensors[f"{base}.lora_A.weight"] = torch.randn(1, fan_in, dtype=torch.bfloat16)
            tensors[f"{base}.lora_B.weight"] = torch.randn(fan_out, 1, dtype=torch.bfloat16)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    reg = Registry.remote()
    ray.get(reg.take.remote(0))
    res = {"tensors": len(tensors), "mbytes": sum(t.numel() * 2 for t in tensors.values()) / 1e6}
    for name, pack in (("dict", lambda t: t), ("packed", pack_tensors)):
        publish, fetch = [], []
        for _ in range(7):
            t0 = time.perf_counter()
            ref = ray.put(pack(tensors))
            ray.get(reg.take.remote(ref))
            t1 = time.perf_counter()
            got = unpack_tensors(ray.get(ref))
            fetch.append(time.perf_counter() - t1)
            publish.append(t1 - t0)
            assert torch.equal(got[next(iter(tensors))], tensors[next(iter(tensors))])
        res[name] = {"publish_ms_p50": 1000 * statistics.median(publish),
                     "fetch_ms_p50": 1000 * statistics.median(fetch)}
        print(name, res[name], flush=True)
    ray.shutdown()
    if out:
        Path(out).write_text(json.dumps({**res, "command": "python -m benchmarks.probes.payload_transport " + out,
                                         "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=1))
    return res


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out_json", nargs="?", help="where the result goes (default: printed only)")
    main(ap.parse_args().out_json)
