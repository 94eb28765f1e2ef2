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
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from app.report import read_rows
from benchmarks._common import summary
from common.ports import free_port

REPO = Path(__file__).resolve().parents[1]

FLEET = "bench"
ADMIN = "bench-fleet-admin-token"
RECIPE = REPO / "recipes" / "tiny-cpu.yaml"
MODES = ("shared", "sequential")
LEASE_S = 30.0
POLL_S = 3.0  # fleet_status and progress lines; a run's end is caught at once by its own waiter thread
PROGRESS_S = 20.0
QUICK_STEPS = 4
RUN_TIMEOUT_S = 3600.0  # per group of runs: a run that hangs fails the benchmark instead of blocking it
GPU_STEP = 0.05  # GPU fractions are multiples of this (Ray keeps resources to 1e-4; 0.05 reads well)
GOAL_RATIO, GOAL_Z, GOAL_SHARE_DEV = 0.7, 3.0, 0.15
# What a merged file and this call must agree on, or the modes would not measure the same runs.
SAME_SETUP = ("recipe", "steps", "replicas", "gpu_fraction", "samples_per_row", "lease_s")


# ---------------------------------------------------------------------------------------- the setup


@dataclass
class Setup:
    """What every run and the fleet share: the recipe, the model built from it, and the overrides (the GPU
    fractions first, then the user's --set)."""

    recipe: Path
    model: Path
    steps: int
    replicas: int
    extra: list[str]
    gpu: bool

    def run_sets(self, name: str, seed: int, out_dir: Path) -> list[str]:
        sets = [f"run.name={name}", f"run.out_dir={out_dir}", f"train.seed={seed}", f"data.shuffle_seed={seed}",
                f"train.total_steps={self.steps}", "train.num_workers=1", "checkpoint.every=0", "eval.path=null",
                f"rollout.replicas={self.replicas}", "rollout.proxy_location=HeadOnly"]
        # On CPU one rollout worker per run spares the 2 cores; on a GPU the recipe's workers x groups_per_worker
        # are what keep the engine's batch full (gpu-1x: 48 groups, three steps in flight), so they stay.
        return sets + ([] if self.gpu else ["rollout.workers=1"]) + self.extra + self.model_sets

    @property
    def model_sets(self) -> list[str]:
        """Last, over any --set model.path: the model built here, by its absolute path."""
        return [f"model.path={self.model}", "model.build_tiny=false"]


def gpu_fraction(kmax: int, replicas: int) -> float:
    """The share of the one GPU each trainer and each replica reserves: K trainers and the replicas fit."""
    return round(math.floor(1.0 / (kmax + replicas) / GPU_STEP + 1e-9) * GPU_STEP, 4)


def gpu_sets(fraction: float) -> list[str]:
    return [f"train.gpus_per_worker={fraction}", f"rollout.gpus_per_replica={fraction}"]


def cluster_cpus(cfg, kmax: int, replicas: int, gpu: bool) -> int:
    """Logical CPUs of the head: enough to place K train workers and the replicas (and the router's 0.1).
    On CPU at least K + 2 x replicas, as the tiny recipe always had (0.4 each there): the machine's real
    cores are what the runs share. On a GPU machine its cores (the recipes reserve 2 per worker and replica)."""
    need = math.ceil(kmax * cfg.train.cpus_per_worker + replicas * cfg.rollout.cpus_per_replica + 0.1)
    return max(os.cpu_count() or 1, need) if gpu else max(4, kmax + 2 * replicas, need)


# ---------------------------------------------------------------------------------------- one run


@dataclass
class Run:
    """One driver subprocess and where it writes."""

    name: str
    seed: int
    out_dir: Path
    proc: subprocess.Popen | None = None
    started: float = 0.0
    ended: float | None = None
    log_path: Path | None = None

    @property
    def metrics(self) -> Path:
        return self.out_dir / self.name / "metrics.jsonl"

    def start(self, setup: Setup, fleet: str | None, address: str) -> None:
        sets = setup.run_sets(self.name, self.seed, self.out_dir)
        if fleet is None:  # a service of its own; Serve keeps the port it first started with, but keep it free
            sets.append(f"rollout.http_port={free_port()}")
        cmd = [sys.executable, "-m", "app", "train", "--config", str(setup.recipe), "--no-progress"]
        cmd += ["--fleet", fleet] if fleet else []
        for s in sets:
            cmd += ["--set", s]
        # The repository first, then whatever PYTHONPATH holds (the GPU machine's dependencies live there).
        pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, RAY_ADDRESS=address, LORA_GRPO_FLEET_TOKEN=ADMIN, PYTHONPATH=pythonpath,
                   TOKENIZERS_PARALLELISM="false", RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S="600")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.out_dir / f"{self.name}.log"
        log = open(self.log_path, "w")
        self.started = time.time()
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()  # the child holds its own descriptor
        # The exit time, exactly: the main loop is busy polling the fleet.
        threading.Thread(target=self._wait, daemon=True, name=f"wait-{self.name}").start()

    def _wait(self) -> None:
        self.proc.wait()
        self.ended = time.time()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def rows(self) -> list[dict]:
        return _rows(self.metrics)

    def log_tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path and self.log_path.exists() else ""


def _rows(path: Path) -> list[dict]:
    return read_rows(path)[0]  # a line being written is skipped


def _z(rows: list[dict], samples_per_row: int) -> float | None:
    from common.stats import proportion_z

    k = len(rows) // 4
    return round(proportion_z(rows[:k], rows[-k:], samples_per_row), 2) if k else None


def _service_start_s(log: str) -> float | None:
    """Seconds from the driver's start to its own service answering healthy (its log line `service: ... (Ns)`)."""
    m = re.search(r"service: app .*?/v1 \((\d+)s\)", log)
    return float(m.group(1)) if m else None


def run_record(run: Run, steps: int, samples_per_row: int) -> dict:
    rows = run.rows()
    sync = [r["publish_to_served_seconds"] for r in rows if r.get("publish_to_served_seconds") is not None]
    rc = run.proc.returncode if run.proc is not None else None
    rec = {"name": run.name, "seed": run.seed, "exit_code": rc,
           "wall_s": round(run.ended - run.started, 1) if run.ended else None,
           "steps": len(rows), "finished": rc == 0 and [r["step"] for r in rows] == list(range(1, steps + 1)),
           "reward_z": _z(rows, samples_per_row), "rewards": [round(r["reward_mean"], 4) for r in rows],
           "publish_to_served_s": sync, "publish_s": [r["publish_seconds"] for r in rows if "publish_seconds" in r]}
    if rows:
        rec["first_step_s"] = round(rows[0]["time"] - run.started, 1)  # process start to step 1 logged
    if not rec["finished"]:
        rec["log_tail"] = run.log_tail()
    return rec


# ---------------------------------------------------------------------------------------- token shares


@dataclass
class Shares:
    """Tokens generated per run, as `fleet_status` reports them while the runs go. The fleet's counters are
    cumulative over its life (and this benchmark's fleet serves every K in turn), so shares are counted here,
    among the group's runs only."""

    runs: list[str]
    last: dict[str, int] = field(default_factory=dict)  # run -> tokens when last seen attached
    fleet_share: dict[str, float] = field(default_factory=dict)  # run -> the fleet's own share, last seen
    all_attached: list[dict[str, int]] = field(default_factory=list)  # snapshots with every run attached
    polls: int = 0
    errors: int = 0

    def poll(self, fleet: str) -> None:
        from app.fleet import fleet_status

        try:
            st = fleet_status(fleet)
        except Exception as e:  # a busy ingress: the next poll may make it
            self.errors += 1
            if self.errors <= 3:
                print(f"  (fleet status: {type(e).__name__}: {e})", flush=True)
            return
        self.polls += 1
        seen = {r: int(v.get("tokens", 0)) for r, v in st.get("runs", {}).items() if r in self.runs}
        self.last.update(seen)
        self.fleet_share.update({r: float(v.get("share", 0.0)) for r, v in st.get("runs", {}).items()
                                 if r in self.runs})
        if len(seen) == len(self.runs):
            self.all_attached.append(seen)

    def result(self) -> dict:
        k = len(self.runs)
        fair = 1.0 / k
        final = _shares(self.last, self.runs)
        window = None
        if len(self.all_attached) >= 2:  # tokens generated between the first and last poll with all K attached
            a, b = self.all_attached[0], self.all_attached[-1]
            window = _shares({r: b[r] - a[r] for r in self.runs}, self.runs)
        elif self.all_attached:
            window = _shares(self.all_attached[-1], self.runs)
        out = {"fair": round(fair, 4), "tokens_last_seen": {r: self.last.get(r) for r in self.runs},
               "share_last_seen": final, "max_rel_dev_last_seen": _max_dev(final, fair),
               "share_all_attached": window, "max_rel_dev_all_attached": _max_dev(window, fair),
               "fleet_reported_share": self.fleet_share, "polls": self.polls, "polls_all_attached":
               len(self.all_attached), "poll_errors": self.errors}
        return out


def _shares(tokens: dict[str, int], runs: list[str]) -> dict[str, float] | None:
    total = sum(max(0, tokens.get(r, 0)) for r in runs)
    return {r: round(max(0, tokens.get(r, 0)) / total, 4) for r in runs} if total else None


def _max_dev(shares: dict[str, float] | None, fair: float) -> float | None:
    return round(max(abs(s - fair) / fair for s in shares.values()), 4) if shares else None



# ---------------------------------------------------------------------------------------- a group of runs


def run_group(label: str, runs: list[Run], setup: Setup, fleet: str | None,
              address: str) -> tuple[float, Shares | None]:
    """Start `runs` at once and wait for the last to exit, polling the fleet's token counts (fleet runs) and
    printing progress. Returns (wall seconds from the first launch to the last exit, the shares seen)."""
    shares = Shares([r.name for r in runs]) if fleet else None
    t0 = time.time()
    for r in runs:
        r.start(setup, fleet, address)
    last_print = t0
    try:
        while any(r.ended is None for r in runs):
            if time.time() - t0 > RUN_TIMEOUT_S:
                print(f"  {label}: timed out after {RUN_TIMEOUT_S:.0f}s; killing the runs", flush=True)
                break
            if shares is not None:
                shares.poll(fleet)
            if time.time() - last_print >= PROGRESS_S:
                last_print = time.time()
                steps_now = ", ".join(f"{r.name} {len(r.rows())}/{setup.steps}" + ("" if r.ended is None else " done")
                                      for r in runs)
                tokens = f"; tokens {shares.last}" if shares is not None and shares.last else ""
                print(f"  {label}: {time.time() - t0:.0f}s, steps {steps_now}{tokens}", flush=True)
            time.sleep(POLL_S if shares is not None else 1.0)
    finally:
        for r in runs:
            r.kill()
            if r.ended is None:  # killed: its waiter thread sets it
                time.sleep(0.5)
    wall = max((r.ended or time.time()) for r in runs) - t0
    print(f"  {label}: {wall:.0f}s, exit codes {[r.proc.returncode for r in runs]}", flush=True)
    return wall, shares


# ---------------------------------------------------------------------------------------- the benchmark


def fleet_config(setup: Setup, slots: int, port: int):
    from common import config as C

    return C.load(str(setup.recipe), [f"rollout.replicas={setup.replicas}", f"rollout.http_port={port}",
                                      "rollout.proxy_location=HeadOnly", f"sync.max_loras={slots}", *setup.extra,
                                      *setup.model_sets])


def _p(xs: list[float]) -> dict:
    s = summary(xs)
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in s.items()}


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


# ---------------------------------------------------------------------------------------- results, merged


SHARED_KEYS = ("fleet_start_s", "fleet_error", "fleet_down_error")


def merge_results(old: dict, new: dict, modes: list[str]) -> dict:
    """`old` (an earlier call's results) with this call's: its shared K's and sequential runs replace the
    earlier ones of the same K / run; the fleet's start and errors are the latest shared call's."""
    out = {"shared": {**old.get("shared", {}), **new["shared"]},
           "sequential_runs": sorted({**{r["name"]: r for r in old.get("sequential_runs", [])},
                                      **{r["name"]: r for r in new["sequential_runs"]}}.values(),
                                     key=lambda r: r["seed"])}
    for key in SHARED_KEYS:
        src = new if "shared" in modes else old
        if key in src:
            out[key] = src[key]
    for key in ("cluster_cpus", "cluster_gpus"):
        out[key] = new.get(key, old.get(key))
    return out


def with_sequential(res: dict, ks: list[int]) -> dict:
    """res["sequential"][K]: runs 0..K-1 one after another, for every K whose runs are all there."""
    by_seed = {r["seed"]: r for r in res["sequential_runs"]}
    seq = {}
    for k in ks:
        if all(i in by_seed for i in range(k)):
            walls = [by_seed[i]["wall_s"] for i in range(k)]
            seq[k] = {"wall_s": round(sum(walls), 1) if None not in walls else None,
                      "runs": [by_seed[i] for i in range(k)]}
    return {**res, "sequential": seq}


def read_merge(path: Path) -> dict:
    """An earlier call's JSON, its K keys ints again (JSON made them strings)."""
    doc = json.loads(path.read_text())
    res = doc["results"]
    res["shared"] = {int(k): v for k, v in res.get("shared", {}).items()}
    res.setdefault("sequential_runs", [])
    return doc


def setup_mismatch(old: dict, new: dict) -> list[str]:
    return [f"{k}: {old.get(k)!r} in the merged file, {new.get(k)!r} here" for k in SAME_SETUP
            if old.get(k) != new.get(k)]


def analyse(res: dict, ks: list[int]) -> dict:
    """Ratios, z, shares and sync latency per K, and the goals."""
    per_k = {}
    for k in ks:
        sh, sq = res["shared"].get(k), res["sequential"].get(k)
        row: dict = {}
        if sh and sq and sq["wall_s"]:
            row["wall_ratio_shared_over_sequential"] = round(sh["wall_s"] / sq["wall_s"], 3)
            start = res.get("fleet_start_s") or 0
            row["wall_ratio_with_fleet_start"] = round((sh["wall_s"] + start) / sq["wall_s"], 3)
        for mode, m in (("shared", sh), ("sequential", sq)):
            if not m:
                continue
            row[f"{mode}_wall_s"] = m["wall_s"]
            row[f"{mode}_z"] = {r["name"]: r["reward_z"] for r in m["runs"]}
            row[f"{mode}_all_finished"] = all(r["finished"] for r in m["runs"])
            row[f"{mode}_publish_to_served_s"] = _p([x for r in m["runs"] for x in r["publish_to_served_s"]])
        if sh:
            row["share_max_rel_dev"] = sh["shares"]["max_rel_dev_all_attached"]
            if row["share_max_rel_dev"] is None:
                row["share_max_rel_dev"] = sh["shares"]["max_rel_dev_last_seen"]
        per_k[k] = row
    zs = [z for row in per_k.values() for mode in ("shared", "sequential") for z in row.get(f"{mode}_z", {}).values()]
    devs = [row["share_max_rel_dev"] for k, row in per_k.items() if k > 1 and "share_max_rel_dev" in row]
    k2 = per_k.get(2, {}).get("wall_ratio_shared_over_sequential")
    targets = {"wall_ratio_le_0.7_at_k2": None if k2 is None else k2 <= GOAL_RATIO,
               "every_z_gt_3": bool(zs) and all(z is not None and z > GOAL_Z for z in zs),
               "shares_within_15pct": None if not devs else all(d is not None and d <= GOAL_SHARE_DEV for d in devs)}
    return {"per_k": per_k, "targets_met": targets}


def print_table(doc: dict) -> None:
    print(f"\nmany runs, one fleet: {doc['steps']} steps per run, {doc['replicas']} replica(s), "
          f"fleet start {doc.get('fleet_start_s')}s (counted apart), {doc['machine']}")
    print(f"{'K':>2} {'shared s':>9} {'seq s':>7} {'ratio':>6} {'+start':>7} {'max share dev':>14} "
          f"{'sync p50 shared/seq':>20}  z (shared | sequential)")
    for k, row in doc["per_k"].items():
        def f(x, fmt):
            return format(x, fmt) if isinstance(x, (int, float)) else "-".rjust(int(fmt.split(".")[0] or 0))
        sync = (f"{f(row.get('shared_publish_to_served_s', {}).get('p50'), '.3f')}/"
                f"{f(row.get('sequential_publish_to_served_s', {}).get('p50'), '.3f')}")
        zs = " ".join(f(z, ".1f") for z in row.get("shared_z", {}).values())
        zq = " ".join(f(z, ".1f") for z in row.get("sequential_z", {}).values())
        print(f"{k:>2} {f(row.get('shared_wall_s'), '9.0f')} {f(row.get('sequential_wall_s'), '7.0f')} "
              f"{f(row.get('wall_ratio_shared_over_sequential'), '6.2f')} "
              f"{f(row.get('wall_ratio_with_fleet_start'), '7.2f')} {f(row.get('share_max_rel_dev'), '14.3f')} "
              f"{sync:>20}  {zs} | {zq}")
    for k, m in doc["results"]["shared"].items():
        sh = m["shares"]
        print(f"K={k} shares (fair {sh['fair']}): all attached {sh['share_all_attached']}, "
              f"last seen {sh['share_last_seen']}")
    print(f"targets: {doc['targets_met']}")


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res, ks = doc["results"], list(doc["per_k"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = list(range(len(ks)))
    shared = [(res["shared"].get(k) or {}).get("wall_s") or 0 for k in ks]
    seq = [(res["sequential"].get(k) or {}).get("wall_s") or 0 for k in ks]
    a.bar([i - 0.2 for i in x], shared, 0.4, label="shared fleet (runs)", color="#2a7")
    a.bar([i - 0.2 for i in x], [doc.get("fleet_start_s") or 0] * len(ks), 0.4, bottom=shared, color="#9d9",
          label="fleet start (once)")
    a.bar([i + 0.2 for i in x], seq, 0.4, label="sequential, own service each", color="#999")
    a.set_xticks(x, [f"K={k}" for k in ks])
    a.set_ylabel("wall seconds")
    a.set_title("K runs: one fleet vs one after another")
    a.legend(fontsize=8)
    curves = [(f"shared K={k} {r['name']}", "-", r) for k, m in res["shared"].items() for r in m["runs"]]
    # Every sequential run once: K runs one after another are the first K of them.
    curves += [(f"sequential {r['name']}", "--", r) for r in res.get("sequential_runs", [])]
    for label, style, r in curves:
        b.plot(range(1, len(r["rewards"]) + 1), r["rewards"], style, label=label)
    b.set_xlabel("step")
    b.set_ylabel("batch reward mean")
    b.set_title("reward per step, each run")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
