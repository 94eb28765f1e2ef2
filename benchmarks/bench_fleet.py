"""Many runs, one fleet (issue 19, docs/FLEET.md "Measuring it"): K tiny runs sharing one rollout fleet against
the same K runs one after another, each with a service of its own, on the same replicas count. Real Ray, Serve,
vLLM and DeepSpeed on a local Ray cluster this process owns (`ray.cluster_utils.Cluster`, as tests/test_fleet.py).

    python -m app bench fleet                    # K = 1, 2; 40 steps per run
    python -m app bench fleet --ks 1,2,4         # also four runs at once (slots >= 4 x 4)
    python -m app bench fleet --quick            # K = 2; 4 steps per run (a smoke check, not a measurement)

Every run is recipes/tiny-cpu.yaml on the embedded tiny model, started as a user starts it: a driver
subprocess `python -m app train` joining the cluster through RAY_ADDRESS (one train worker, one rollout
worker, no checkpoints, no evaluation, a fixed number of steps). Run i of every mode has the same config
(train.seed = data.shuffle_seed = i), so the modes train the same runs.

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
last quarter of its steps, app.report.proportion_z), shares within 15% of fair (1 / K). Prints a table and
writes benchmarks/results/fleet.json and fleet.png (fleet_quick.* with --quick; --out DIR to put them
elsewhere): wall time per K per mode, and each run's reward curve.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from app.report import read_rows  # noqa: E402
from benchmarks._common import free_port, summary  # noqa: E402

FLEET = "bench"
ADMIN = "bench-fleet-admin-token"
RECIPE = REPO / "recipes" / "tiny-cpu.yaml"
LEASE_S = 30.0
POLL_S = 3.0  # fleet_status and progress lines; a run's end is caught at once by its own waiter thread
PROGRESS_S = 20.0
SLOTS_PER_RUN = 4  # max_staleness 2 + 2 (tiny-cpu, no evaluation)
QUICK_STEPS = 4
RUN_TIMEOUT_S = 3600.0  # per group of runs: a run that hangs fails the benchmark instead of blocking it
GOAL_RATIO, GOAL_Z, GOAL_SHARE_DEV = 0.7, 3.0, 0.15


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

    def start(self, model: Path, steps: int, replicas: int, fleet: str | None, address: str,
              extra: list[str]) -> None:
        sets = [f"model.path={model}", "model.build_tiny=false", f"run.name={self.name}", f"run.out_dir={self.out_dir}",
                f"train.seed={self.seed}", f"data.shuffle_seed={self.seed}", f"train.total_steps={steps}",
                "train.num_workers=1", "rollout.workers=1", "checkpoint.every=0", "eval.path=null",
                f"rollout.replicas={replicas}", "rollout.proxy_location=HeadOnly", *extra]
        if fleet is None:  # a service of its own; Serve keeps the port it first started with, but keep it free
            sets.append(f"rollout.http_port={free_port()}")
        cmd = [sys.executable, "-m", "app", "train", "--config", str(RECIPE), "--no-progress"]
        cmd += ["--fleet", fleet] if fleet else []
        for s in sets:
            cmd += ["--set", s]
        env = dict(os.environ, RAY_ADDRESS=address, LORA_GRPO_FLEET_TOKEN=ADMIN, PYTHONPATH=str(REPO),
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
    from app.report import proportion_z

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


def run_group(label: str, runs: list[Run], model: Path, steps: int, replicas: int, fleet: str | None,
              address: str, extra: list[str]) -> tuple[float, Shares | None]:
    """Start `runs` at once and wait for the last to exit, polling the fleet's token counts (fleet runs) and
    printing progress. Returns (wall seconds from the first launch to the last exit, the shares seen)."""
    shares = Shares([r.name for r in runs]) if fleet else None
    t0 = time.time()
    for r in runs:
        r.start(model, steps, replicas, fleet, address, extra)
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
                steps_now = ", ".join(f"{r.name} {len(r.rows())}/{steps}" + ("" if r.ended is None else " done")
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


def fleet_config(model: Path, replicas: int, slots: int, port: int, extra: list[str]):
    from common import config as C

    return C.load(str(RECIPE), [f"model.path={model}", "model.build_tiny=false", f"rollout.replicas={replicas}",
                                f"rollout.http_port={port}", "rollout.proxy_location=HeadOnly",
                                f"sync.max_loras={slots}", *extra])


def _p(xs: list[float]) -> dict:
    s = summary(xs)
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in s.items()}


def bench(work: Path, model: Path, ks: list[int], steps: int, replicas: int, slots: int, extra: list[str],
          samples_per_row: int) -> dict:
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from app.fleet import fleet_down, fleet_up

    kmax = max(ks)
    # Logical CPUs: enough to place the fleet's replicas and K train workers (0.4 each in tiny-cpu); the machine's
    # real cores are what the runs share.
    cpus = max(4, kmax + 2 * replicas)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus, "include_dashboard": False})
    ray.init(address=cluster.address, log_to_driver=False)
    out: dict = {"shared": {}, "sequential": {}, "cluster_cpus": cpus}
    try:
        # ---- shared: one fleet, started once; each K attaches K runs at once.
        print(f"fleet up: {replicas} replica(s), {slots} adapter slots", flush=True)
        t0 = time.time()
        try:
            up = fleet_up(fleet_config(model, replicas, slots, free_port(), extra), FLEET, slots, LEASE_S,
                          admin_token=ADMIN)
        except Exception as e:
            out["fleet_error"] = f"{type(e).__name__}: {e}"[-3000:]
            print(f"fleet up failed: {out['fleet_error']}", flush=True)
            up = None
        out["fleet_start_s"] = round(time.time() - t0, 1)
        print(f"fleet up: {out['fleet_start_s']:.0f}s", flush=True)
        if up is not None:
            try:
                for k in ks:
                    runs = [Run(f"k{k}-r{i}", i, work / f"shared-k{k}") for i in range(k)]
                    wall, shares = run_group(f"shared K={k}", runs, model, steps, replicas, FLEET, cluster.address,
                                             extra)
                    out["shared"][k] = {"wall_s": round(wall, 1), "shares": shares.result(),
                                        "runs": [run_record(r, steps, samples_per_row) for r in runs]}
            finally:
                try:
                    fleet_down(FLEET, ADMIN)
                except Exception as e:  # reported; the sequential runs still go (their own services)
                    out["fleet_down_error"] = f"{type(e).__name__}: {e}"[-3000:]
                    print(f"fleet down failed: {out['fleet_down_error']}", flush=True)
        # ---- sequential: each run with its own service, one after another (the fleet is down).
        seq = []
        for i in range(kmax):
            run = Run(f"seq-r{i}", i, work / "sequential")
            run_group(f"sequential run {i + 1}/{kmax}", [run], model, steps, replicas, None, cluster.address, extra)
            rec = run_record(run, steps, samples_per_row)
            rec["service_start_s"] = _service_start_s(run.log_tail(10 ** 7))
            seq.append(rec)
        for k in ks:
            walls = [r["wall_s"] for r in seq[:k]]
            out["sequential"][k] = {"wall_s": round(sum(walls), 1) if None not in walls else None, "runs": seq[:k]}
    finally:
        try:
            serve.shutdown()
        except Exception as e:
            print(f"  (serve shutdown: {e})", flush=True)
        ray.shutdown()
        cluster.shutdown()
    return out


def analyse(res: dict, ks: list[int]) -> dict:
    """Ratios, z, shares and sync latency per K, and the goals."""
    per_k = {}
    for k in ks:
        sh, sq = res["shared"].get(k), res["sequential"].get(k)
        row: dict = {}
        if sh and sq and sq["wall_s"]:
            row["wall_ratio_shared_over_sequential"] = round(sh["wall_s"] / sq["wall_s"], 3)
            row["wall_ratio_with_fleet_start"] = round((sh["wall_s"] + res["fleet_start_s"]) / sq["wall_s"], 3)
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
            return format(x, fmt) if isinstance(x, (int, float)) else "-"
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
    for mode, style in (("shared", "-"), ("sequential", "--")):
        for k, m in res[mode].items():
            if mode == "sequential" and k != max(ks):  # the same runs as the largest K's
                continue
            for r in m["runs"]:
                b.plot(range(1, len(r["rewards"]) + 1), r["rewards"], style, label=f"{mode} K={k} {r['name']}")
    b.set_xlabel("step")
    b.set_ylabel("batch reward mean")
    b.set_title("reward per step, each run")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ks", default="1,2", help="comma-separated numbers of runs (default 1,2; 4 works too)")
    p.add_argument("--steps", type=int, default=40, help="train.total_steps of every run")
    p.add_argument("--replicas", type=int, default=1, help="vLLM replicas: the fleet's, and each sequential run's")
    p.add_argument("--slots", type=int, default=None, help=f"the fleet's adapter slots (default {SLOTS_PER_RUN} x "
                                                           "max K; at least that)")
    p.add_argument("--quick", action="store_true", help=f"K = 2 at {QUICK_STEPS} steps: a smoke check")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config overrides for every run and the fleet")
    args = p.parse_args(argv)
    ks = [2] if args.quick else sorted({int(k) for k in args.ks.split(",")})
    steps = QUICK_STEPS if args.quick else args.steps
    slots = args.slots or SLOTS_PER_RUN * max(ks)
    if slots < SLOTS_PER_RUN * max(ks):
        p.error(f"--slots {slots}: {max(ks)} runs need {SLOTS_PER_RUN} adapter slots each")

    from app.tiny_model import ensure_model
    from common import config as C

    cfg = C.load(str(RECIPE), args.set)
    samples_per_row = cfg.grpo.prompts_per_step * cfg.grpo.group_size
    model = ensure_model(REPO / "runs" / "tiny-model")
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        res = bench(Path(tmp), Path(model), ks, steps, args.replicas, slots, args.set, samples_per_row)
    doc = {"command": " ".join(["python -m app bench fleet", *(argv if argv is not None else sys.argv[1:])]),
           "quick": args.quick, "ks": ks, "steps": steps, "replicas": args.replicas, "slots": slots,
           "lease_s": LEASE_S, "samples_per_row": samples_per_row, "overrides": args.set,
           "machine": f"{platform.machine()}, {os.cpu_count()} cores", "fleet_start_s": res.get("fleet_start_s"),
           "goals": {"wall_ratio_at_k2_le": GOAL_RATIO, "z_gt": GOAL_Z, "share_rel_dev_le": GOAL_SHARE_DEV},
           **analyse(res, ks), "results": res}
    print_table(doc)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "fleet_quick" if args.quick else "fleet"
    (out / f"{name}.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    plot(doc, out / f"{name}.png")
    print(f"wrote {out / (name + '.json')} and .png", flush=True)
    ok = "fleet_error" not in res and all(
        r["finished"] for mode in ("shared", "sequential") for m in res[mode].values() for r in m["runs"])
    ok = ok and all(k in res["shared"] and k in res["sequential"] for k in ks)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
