"""benchmarks/bench_adapter_sync.py's part (a), the full path: the real Serve app with vLLM replicas on the
tiny model, adapter and merged publishes timed from the trainer side until every replica serves them; and
perturbed(), the new payload per publish that part (b) uses too."""
from __future__ import annotations

import time
from pathlib import Path

from app.tiny_model import serve_config
from benchmarks._common import delete_app, rss_bytes, summary
from common.adapter_io import pack_tensors
from common.lora_payloads import make_lora_payload, make_merged_payload, prompt_ids
from common.registry import retire_all


def perturbed(tensors: dict, i: int) -> dict:
    """A new payload per publish, as a trainer step would give: one tensor changed (new digest)."""
    out = dict(tensors)
    k = sorted(out)[0]
    out[k] = out[k] + (i + 1) * 1e-3
    return out


# ---------------------------------------------------------------------------------------- (a) full path


def full_path(args, model_dir: Path, registry, http_port: int) -> list[dict]:
    import ray

    from common.adapter_io import make_meta
    from serve_deployments.app_builder import start_service, wait_healthy

    base_adapters = [make_lora_payload(model_dir, seed=10 + i, rank=args.rank) for i in range(2)]
    base_merged = [make_merged_payload(model_dir, t, m) for t, m in base_adapters]
    prompt = prompt_ids(model_dir, "sync check: answer with A")
    version = ray.get(registry.latest_version.remote()) + 1
    rows = []
    for R in args.replicas:
        row = {"replicas": R, "adapter_nbytes": base_adapters[0][1]["nbytes"],
               "merged_nbytes": base_merged[0][1]["nbytes"],
               # object-store copies per publish: trainer put, registry re-put, one fetch per replica
               "adapter_bytes_moved": base_adapters[0][1]["nbytes"] * (2 + R),
               "merged_bytes_moved": base_merged[0][1]["nbytes"] * (2 + R)}
        rows.append(row)
        cfg = serve_config(model_dir, replicas=R, cpus_per_replica=args.cpus_per_replica, max_lora_rank=args.rank,
                           kv_cache_gib=args.kv_cache_gib, max_num_seqs=8)
        cfg = cfg.replace(rollout={"http_port": http_port, "app_name": f"adapter-sync-r{R}"},
                          router={"policy": "prefix"})
        retire_all(registry)  # new replicas start with nothing to load
        t0 = time.perf_counter()
        try:
            handle = start_service(cfg, registry=registry)
            wait_healthy(handle, timeout_s=args.start_timeout)
        except Exception as e:  # too many engines for this machine's memory/time: report what ran
            row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:400]
            print(f"  R={R}: service did not start: {row['error']}", flush=True)
            delete_app(cfg.rollout.app_name)
            continue
        row["start_s"] = time.perf_counter() - t0
        print(f"  R={R}: service up in {row['start_s']:.1f}s", flush=True)
        try:
            for mode, bases, n in (("adapter", base_adapters, args.publishes),
                                   ("merged", base_merged, args.merge_publishes)):
                recs = []
                for i in range(n + 1):  # the first one is a warm-up (first add_lora / first weight reload)
                    tensors = perturbed(bases[i % len(bases)][0], version)
                    t_d = time.perf_counter()
                    meta = make_meta(tensors, bases[i % len(bases)][1]["peft_config"], kind=mode)
                    t_p = time.perf_counter()
                    ref = ray.put(pack_tensors(tensors))
                    t_q = time.perf_counter()
                    rec = ray.get(registry.publish.remote(version, ref, meta))
                    t_r = time.perf_counter()
                    out = handle.generate_group.remote(
                        prompt, 1, version, {"max_tokens": 1, "temperature": 0.0}
                    ).result()
                    t_g = time.perf_counter()
                    assert out[0]["version"] == version and len(out[0]["token_ids"]) == 1, out
                    st = handle.stats.remote().result()
                    reps = st["replicas"]
                    have = [(s["base_version"] == version) if mode == "merged" else (version in s["versions"])
                            for s in reps]
                    if len(reps) != R or not all(have):
                        raise RuntimeError(f"policy-v{version} not served by every replica after publish: {reps}")
                    r = {"version": version, "digest_s": t_p - t_d, "put_s": t_q - t_p, "publish_s": t_r - t_q,
                         "total_s": t_r - t_p, "registry_s": rec["seconds"], "broadcast_s": rec["replica_load_seconds"],
                         "confirm_generate_s": t_g - t_r, "publish_to_served_s": t_g - t_p}
                    if mode == "adapter":
                        r["add_lora_ms_max"] = max(s["add_lora_ms"][-1] for s in reps)
                    if i:
                        recs.append(r)
                    version += 1
                row[mode] = {k: summary([x[k] for x in recs]) for k in recs[0] if k != "version"}
                row[mode]["samples"] = recs
                print(f"  R={R} {mode:<7}: p50 {row[mode]['total_s']['p50'] * 1e3:7.1f} ms  p95 "
                      f"{row[mode]['total_s']['p95'] * 1e3:7.1f} ms  (publish->served p50 "
                      f"{row[mode]['publish_to_served_s']['p50'] * 1e3:.1f} ms)", flush=True)
            st = handle.stats.remote().result()
            row["replica_rss_gib"] = [round(rss_bytes(s["pid"]) / 2**30, 2) for s in st["replicas"]]
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1]}"[:400]
            print(f"  R={R}: failed: {row['error']}", flush=True)
        finally:
            delete_app(cfg.rollout.app_name)
        if "adapter" in row and "merged" in row:
            row["latency_ratio_merged_over_adapter_p50"] = (
                row["merged"]["total_s"]["p50"] / row["adapter"]["total_s"]["p50"]
            )
            row["bytes_ratio_merged_over_adapter"] = row["merged_nbytes"] / row["adapter_nbytes"]
    return rows
