"""One REST request at a time: what the Serve port adds to a request's latency over the replica's own port.

`rest_vs_vllm.py` measures throughput with 16 requests in flight; on a machine with cores to spare (the H200's
16) that is set by each request's latency, and the Serve port's hops (HTTP proxy -> Ingress -> replica) are
what it adds. Here one client sends requests one after another (no queueing, so the difference is the path
itself): completions, non-streaming and streaming, 1 and 16 new tokens, 25 each, the median per round, two
rounds, both ports of one service (the tiny model on CPU, the rank-8 adapter of `rest_vs_vllm.py`).

    python -m benchmarks.probes.rest_latency OUT.json [--direct-ingress]

`--direct-ingress`: Ray Serve's direct ingress (the Ingress replica serves HTTP itself, no proxy hop), as in
`rest_vs_vllm.py`. Serve's own tuning flags come from the environment, e.g.
`RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0` (recorded in the JSON).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import rest_vs_vllm as rv

CASES = [(stream, tokens) for stream in (False, True) for tokens in (1, 16)]


def request_ms(port: int, stream: bool, max_tokens: int) -> float:
    r = rv.probe(port, "completions", timeout_s=60, max_tokens=max_tokens, stream=stream)
    if r["status"] != 200:
        raise RuntimeError(f"status {r['status']} from :{port}: {r['body'][:300]}")
    return r["seconds"] * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--direct-ingress", action="store_true")
    p.add_argument("--requests", type=int, default=25)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()

    import ray

    from app.tiny_model import ensure_model
    from common.lora_payloads import make_lora_payload

    work = Path(tempfile.mkdtemp(prefix="rest-latency-"))
    model = ensure_model(work / "tiny-model", shape="tiny")
    tensors, meta = make_lora_payload(model, seed=1, rank=rv.WORKLOAD["lora_rank"])
    ports, held = rv.start_rest(rv.service_config(model, 0), (tensors, meta), direct_ingress=args.direct_ingress)
    sides = {"serve_port": ports["rest"], "replica_port": ports["direct"]}
    for port in sides.values():  # warm-up: the first requests compile and fill caches
        for _ in range(5):
            request_ms(port, False, 1)
    runs: dict = {}
    for rnd in range(args.rounds):
        for side, port in sides.items():
            for stream, tokens in CASES:
                ms = statistics.median(request_ms(port, stream, tokens) for _ in range(args.requests))
                runs.setdefault(f"stream={stream} max_tokens={tokens}", {}).setdefault(side, []).append(ms)
                print(f"round {rnd + 1} {side:12s} stream={stream!s:5s} max_tokens={tokens:2d}: {ms:6.1f} ms",
                      flush=True)
    added = {case: statistics.median(v["serve_port"]) - statistics.median(v["replica_port"])
             for case, v in runs.items()}
    doc = {"command": "python -m benchmarks.probes.rest_latency " + " ".join(sys.argv[1:]),
           "direct_ingress": args.direct_ingress,
           "serve_env": {k: v for k, v in os.environ.items() if k.startswith("RAY_SERVE_")},
           "requests_per_case": args.requests, "rounds": args.rounds, "median_ms_per_round": runs,
           "serve_port_adds_ms": added, "cpus": os.cpu_count(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                            time.gmtime())}
    Path(args.out).write_text(json.dumps(doc, indent=2))
    for case, ms in added.items():
        print(f"{case:28s} the Serve port adds {ms:5.1f} ms", flush=True)
    del held  # the registry, held until here: it dies with its owner's last handle
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
