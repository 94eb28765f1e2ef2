"""Many runs, one fleet (docs/FLEET.md "Measuring it"): K tiny runs sharing one rollout fleet against
the same K runs one after another, each with a service of its own, on the same replicas count. Real Ray, Serve,
vLLM and DeepSpeed on a local Ray cluster this process owns (`ray.cluster_utils.Cluster`, as tests/test_fleet.py).

    python -m app bench fleet                    # K = 1, 2; 40 steps per run
    python -m app bench fleet --ks 1,2,4         # also four runs at once (slots >= 4 x 4)
    python -m app bench fleet --quick            # K = 2; 4 steps per run (a smoke check, not a measurement)
    # one GPU, in two calls (each mode fits one); the second adds its mode to the first's JSON:
    python -m app bench fleet --recipe recipes/gpu-1x.yaml --ks 2,4 --steps 60 --modes shared --name fleet_gpu
    python -m app bench fleet --recipe recipes/gpu-1x.yaml --ks 2,4 --steps 60 --modes sequential \
        --name fleet_gpu --merge-into benchmarks/results/fleet_gpu.json

Every run is the recipe (--recipe, default recipes/tiny-cpu.yaml) on its model.path, built once here first
when model.build_tiny (as the driver's preflight builds it), started as a user starts it: a driver
subprocess `python -m app train` joining the cluster through RAY_ADDRESS (one train worker, no checkpoints,
no evaluation, a fixed number of steps; one rollout worker on CPU). Run i of every mode has the same config
(train.seed = data.shuffle_seed = i), so the modes train the same runs. A GPU recipe (train.use_gpu) puts
everything on ONE GPU: the K trainers and the replicas each get --gpu-fraction of it (default
1 / (max K + replicas), rounded down to 0.05), in both modes, and the engine keeps the recipe's
gpu_memory_utilization.

- shared: one fleet (`app.fleet.fleet_up`, --replicas, --slots adapter slots) is started once, its start timed
  on its own; for each K, K runs attach at once (`train --fleet`). Wall time: from launching the K drivers to
  the last one exiting. While they run, `fleet_status` is polled for each run's generated tokens; the share is
  counted two ways: over the tokens last seen per run (runs leave the fleet at their end), and over the
  tokens generated while all K runs were attached (the window where the fair queue decides anything).
- sequential: the same runs one after another, each starting (and timing) its own service on a free HTTP port.
  Runs are independent, so the sequential wall time of K runs is the sum of the first K runs' wall times: each
  run is made once, for the largest K. The fleet is down by then (one service on the cluster at a time).
- adapter sync under K runs: each row's `publish_to_served_seconds` (the trainer's hand-over until every
  replica serves the new version), p50 / p95 per mode and K.

Goals (docs/FLEET.md): shared <= 0.7 x sequential wall time at K = 2, reward z > 3 for every run (first vs
last quarter of its steps, common.stats.proportion_z), shares within 15% of fair (1 / K). Prints a table and
writes benchmarks/results/fleet.json and fleet.png (fleet_quick.* with --quick; --name and --out to put them
elsewhere): wall time per K per mode, and each run's reward curve. The JSON is rewritten after every group
of runs, so a call cut short keeps what it measured. --modes picks shared, sequential or both; --merge-into
FILE adds this call's results to FILE's (same recipe, steps, replicas, GPU fraction; the newer call's
shared K or sequential run replaces the older's) and analyses and plots them together; --seq-from N makes
only the sequential runs N.. (a third call when K runs one after another do not fit one).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# The runs and the results' merging, analysis, table and plot live in the _bench_fleet_* modules; tests import
# their names through this module (bf.MODES, bf.merge_results, bf.gpu_fraction, ...).
from benchmarks._bench_fleet_results import (
    GOAL_RATIO,
    GOAL_SHARE_DEV,
    GOAL_Z,
    analyse,
    merge_results,
    plot,
    print_table,
    read_merge,
    setup_mismatch,
    with_sequential,
)
from benchmarks._bench_fleet_runs import (
    ADMIN,
    FLEET,
    GPU_STEP,
    LEASE_S,
    REPO,
    Run,
    Setup,
    _service_start_s,
    cluster_cpus,
    gpu_fraction,
    gpu_sets,
    run_group,
    run_record,
)
from common.ports import free_port

RECIPE = REPO / "recipes" / "tiny-cpu.yaml"
MODES = ("shared", "sequential")
QUICK_STEPS = 4


# ---------------------------------------------------------------------------------------- the benchmark


def fleet_config(setup: Setup, slots: int, port: int):
    from common import config as C

    return C.load(str(setup.recipe), [f"rollout.replicas={setup.replicas}", f"rollout.http_port={port}",
                                      "rollout.proxy_location=HeadOnly", f"sync.max_loras={slots}", *setup.extra,
                                      *setup.model_sets])


def bench_shared(work: Path, setup: Setup, ks: list[int], slots: int, samples_per_row: int, address: str,
                 res: dict, save: Callable[[], None]) -> None:
    """One fleet, started once; each K attaches K runs at once. Fills res["shared"] and the fleet's keys."""
    from app.fleet import fleet_down, fleet_up

    print(f"fleet up: {setup.replicas} replica(s), {slots} adapter slots", flush=True)
    t0 = time.time()
    try:
        up = fleet_up(fleet_config(setup, slots, free_port()), FLEET, slots, LEASE_S, admin_token=ADMIN)
    except Exception as e:
        res["fleet_error"] = f"{type(e).__name__}: {e}"[-3000:]
        print(f"fleet up failed: {res['fleet_error']}", flush=True)
        up = None
    res["fleet_start_s"] = round(time.time() - t0, 1)
    print(f"fleet up: {res['fleet_start_s']:.0f}s", flush=True)
    if up is None:
        return
    try:
        for k in ks:
            runs = [Run(f"k{k}-r{i}", i, work / f"shared-k{k}") for i in range(k)]
            wall, shares = run_group(f"shared K={k}", runs, setup, FLEET, address)
            res["shared"][k] = {"wall_s": round(wall, 1), "shares": shares.result(),
                                "runs": [run_record(r, setup.steps, samples_per_row) for r in runs]}
            save()
    finally:
        try:
            fleet_down(FLEET, ADMIN)
        except Exception as e:  # reported; the sequential runs still go (their own services)
            res["fleet_down_error"] = f"{type(e).__name__}: {e}"[-3000:]
            print(f"fleet down failed: {res['fleet_down_error']}", flush=True)


def bench_sequential(work: Path, setup: Setup, seeds: range, samples_per_row: int, address: str, res: dict,
                     save: Callable[[], None]) -> None:
    """Runs `seeds` one after another, each with its own service (no fleet on the cluster by then). Runs are
    independent, so K runs one after another are the first K of these: res["sequential_runs"]."""
    for i in seeds:
        run = Run(f"seq-r{i}", i, work / "sequential")
        run_group(f"sequential run {i + 1}/{seeds.stop}", [run], setup, None, address)
        rec = run_record(run, setup.steps, samples_per_row)
        rec["service_start_s"] = _service_start_s(run.log_tail(10 ** 7))
        res["sequential_runs"].append(rec)
        save()


def bench(work: Path, setup: Setup, ks: list[int], modes: list[str], seq_from: int, slots: int,
          samples_per_row: int, cpus: int, save: Callable[[dict], None]) -> dict:
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    head = {"num_cpus": cpus, "num_gpus": 1 if setup.gpu else 0, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    ray.init(address=cluster.address, log_to_driver=False)
    res: dict = {"shared": {}, "sequential_runs": [], "cluster_cpus": cpus, "cluster_gpus": head["num_gpus"]}
    try:
        if "shared" in modes:
            bench_shared(work, setup, ks, slots, samples_per_row, cluster.address, res, lambda: save(res))
        if "sequential" in modes:
            bench_sequential(work, setup, range(seq_from, max(ks)), samples_per_row, cluster.address, res,
                             lambda: save(res))
    finally:
        try:
            serve.shutdown()
        except Exception as e:
            print(f"  (serve shutdown: {e})", flush=True)
        ray.shutdown()
        cluster.shutdown()
    return res


def build_model(cfg) -> Path:
    """The recipe's model, where the runs will read it: built first when model.build_tiny, by the call the
    driver's preflight makes (app.tiny_model.ensure_model, the recipe's shape and seed), so K runs started at
    once do not all build it. A relative path is the repository's: the runs start there."""
    from app.tiny_model import ensure_model

    path = Path(cfg.model.path)
    path = path if path.is_absolute() else REPO / path
    built = Path(ensure_model(path, cfg.model.build_tiny, cfg.model.tiny_seed, cfg.model.tiny_shape))
    if "torch" in sys.modules:  # the small shape pretrains on the GPU: leave its memory to the runs
        import torch

        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
    return built


def write(doc: dict, out: Path, name: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    plot(doc, out / f"{name}.png")


def _device() -> str:
    """The GPU the runs shared (its name, as torch reports it), or "CPU"."""
    import torch

    return f"1 x {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "CPU"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default=str(RECIPE.relative_to(REPO)),
                   help="the runs' and the fleet's recipe (default recipes/tiny-cpu.yaml; a GPU one: all on one GPU)")
    p.add_argument("--ks", default="1,2", help="comma-separated numbers of runs (default 1,2; 4 works too)")
    p.add_argument("--steps", type=int, default=40, help="train.total_steps of every run")
    p.add_argument("--replicas", type=int, default=1, help="vLLM replicas: the fleet's, and each sequential run's")
    p.add_argument("--slots", type=int, default=None, help="the fleet's adapter slots (default (max_staleness + 2) x "
                                                           "max K; at least that)")
    p.add_argument("--gpu-fraction", type=float, default=None,
                   help="GPU recipes: train.gpus_per_worker and rollout.gpus_per_replica of every run and the fleet "
                        f"(default 1 / (max K + replicas) rounded down to {GPU_STEP}; the merged file's with "
                        "--merge-into)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: shared, sequential (default both)")
    p.add_argument("--seq-from", type=int, default=0, help="sequential mode: make runs N .. max K - 1 only")
    p.add_argument("--merge-into", default=None, metavar="FILE",
                   help="an earlier call's JSON: write its results and this call's together (to --out/--name)")
    p.add_argument("--quick", action="store_true", help=f"K = 2 at {QUICK_STEPS} steps: a smoke check")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--name", default=None, help="output file names NAME.json / NAME.png (default fleet, "
                                                "fleet_quick with --quick)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config overrides for every run and the fleet")
    args = p.parse_args(argv)
    ks = [2] if args.quick else sorted({int(k) for k in args.ks.split(",")})
    steps = QUICK_STEPS if args.quick else args.steps
    modes = [m for m in args.modes.split(",") if m]
    if set(modes) - set(MODES):
        p.error(f"--modes {args.modes}: each of {', '.join(MODES)}")
    if not 0 <= args.seq_from < max(ks):
        p.error(f"--seq-from {args.seq_from}: sequential runs are 0 .. {max(ks) - 1}")
    recipe = Path(args.recipe)
    recipe = recipe if recipe.is_absolute() or recipe.exists() else REPO / recipe
    old = read_merge(Path(args.merge_into)) if args.merge_into else None

    from common import config as C

    cfg = C.load(str(recipe), args.set)
    gpu = cfg.train.use_gpu
    fraction = None
    if gpu:
        fraction = args.gpu_fraction or (old or {}).get("gpu_fraction") or gpu_fraction(max(ks), args.replicas)
        if fraction < GPU_STEP or fraction * (max(ks) + args.replicas) > 1 + 1e-9:
            p.error(f"GPU fraction {fraction}: {max(ks)} trainers and {args.replicas} replica(s) must each get at "
                    f"least {GPU_STEP} of the one GPU and fit on it together; fewer runs (--ks) or a smaller "
                    "--gpu-fraction")
        cfg = C.load(str(recipe), gpu_sets(fraction) + args.set)
    slots_per_run = cfg.adapter_slots
    slots = args.slots or slots_per_run * max(ks)
    if slots < slots_per_run * max(ks):
        p.error(f"--slots {slots}: {max(ks)} runs need {slots_per_run} adapter slots each")
    samples_per_row = cfg.grpo.prompts_per_step * cfg.grpo.group_size
    name = args.name or ("fleet_quick" if args.quick else "fleet")
    command = " ".join(["python -m app bench fleet", *(argv if argv is not None else sys.argv[1:])])
    head = {"recipe": str(recipe.resolve().relative_to(REPO) if recipe.resolve().is_relative_to(REPO) else recipe),
            "quick": args.quick, "steps": steps, "replicas": args.replicas, "gpu_fraction": fraction,
            "lease_s": LEASE_S, "samples_per_row": samples_per_row}
    if old is not None and (bad := setup_mismatch(old, head)):
        p.error(f"--merge-into {args.merge_into}: not the same runs ({'; '.join(bad)})")

    try:
        model = build_model(cfg)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    setup = Setup(recipe, model, steps, args.replicas, (gpu_sets(fraction) if gpu else []) + args.set, gpu)
    out = Path(args.out)
    all_ks = sorted(set(ks) | set((old or {}).get("ks", [])))

    def document(res: dict) -> dict:
        merged = merge_results(old["results"], res, modes) if old else res
        merged = with_sequential(merged, all_ks)
        return {"command": command, "commands": [*((old.get("commands") or [old["command"]]) if old else []), command],
                **head, "modes": [m for m in MODES if m in modes or m in (old or {}).get("modes", [])],
                "model": str(model), "ks": all_ks, "slots": slots if "shared" in modes or not old else old.get("slots"),
                "overrides": args.set, "machine": f"{platform.machine()}, {os.cpu_count()} cores", "device": _device(),
                "fleet_start_s": merged.get("fleet_start_s"),
                "goals": {"wall_ratio_at_k2_le": GOAL_RATIO, "z_gt": GOAL_Z, "share_rel_dev_le": GOAL_SHARE_DEV},
                **analyse(merged, all_ks), "results": merged}

    def save(res: dict) -> None:  # after every group: a call cut short keeps what it measured
        write(document(res), out, name)

    cpus = cluster_cpus(cfg, max(ks), args.replicas, gpu)
    print(f"recipe {head['recipe']}, model {model}, K {ks}, modes {modes}, {steps} steps, {cpus} CPUs"
          + (f", GPU fraction {fraction} each" if gpu else ""), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        res = bench(Path(tmp), setup, ks, modes, args.seq_from, slots, samples_per_row, cpus, save)
    doc = document(res)
    print_table(doc)
    write(doc, out, name)
    print(f"wrote {out / (name + '.json')} and .png", flush=True)
    # This call's own work decides the exit code; a merged file's gaps are the other call's.
    ok = "fleet_error" not in res if "shared" in modes else True
    ok = ok and all(k in res["shared"] for k in ks) if "shared" in modes else ok
    ok = ok and len(res["sequential_runs"]) == max(ks) - args.seq_from if "sequential" in modes else ok
    runs = [r for m in res["shared"].values() for r in m["runs"]] + res["sequential_runs"]
    return 0 if ok and all(r["finished"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
