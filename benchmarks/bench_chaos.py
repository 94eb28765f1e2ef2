"""Chaos soak: one long tiny run on a local multi-node cluster, SIGKILLs at random intervals.

    python -m app bench chaos --minutes 20 --seed 1   # ~25 min with start-up
    python -m app bench chaos --quick                 # ~3 min of faults (at least two), a smoke run by hand

The cluster: a head with 0 CPUs (the driver, the run's own 0-CPU actors, the Serve controller and proxy) and
two 2-CPU worker nodes (`ray.cluster_utils.Cluster`). The run's CPU actors (2 vLLM replicas and 2 train workers
at 0.4 CPU, the ingress at 0.1) fit on one node, so losing a node never leaves the run unplaceable; the node is
added back at once anyway. `Cluster.add_node` must run on the main thread, so the main thread injects the faults
and the driver (`python -m app train`) runs as a subprocess joining the cluster (run.ray_address).

Faults, from random.Random(seed): wait a random interval after the previous fault was survived (a step logged
after it), then SIGKILL one of: a vLLM replica, the router ingress, a rollout worker, a train worker (these four
found as `bench reliability` finds them), the Serve controller's process, or a whole worker node. Each fault's
recovery time is fault -> next step logged. Faults stop M minutes after the first step; the run is sized
(train.total_steps) to last about M minutes at --step-s seconds a step and then runs to its end, so summary.json
holds the buffer's pending prompts and the data accounting (common/data_accounting.py) is exact: a
Ctrl-C stop at M minutes would write no summary.json. The run trains at a third of the recipe's lr with a KL
term (SOAK_LR, SOAK_KL): the recipe's settings collapse the policy over a soak's ~1,500 steps. Goal: accounting
all 0, reward z > 3 (first vs last quarter, app.report.proportion_z). Writes benchmarks/results/chaos.json and
chaos.png (chaos_quick.* with --quick) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_node_loss import NodeKiller
from benchmarks.bench_reliability import (
    Injector,
    _alive_actors,
    _end_group,
    _kill_pid,
    _rows,
    _train_proc,
)
from common.data_accounting import data_accounting
from common.ports import free_port

REPO = Path(__file__).resolve().parents[1]

KINDS = ("replica", "router", "rollout_worker", "train_worker", "controller", "node")
NODE_CPUS = 2
WORKER_NODES = 2  # the run's 1.7 CPUs fit on one: a node's loss never leaves it unplaceable
PER_STEP, GROUP = 8, 4
RECOVERY_TIMEOUT_S = 900
SOAK_LR, SOAK_KL = 1e-3, 0.05


def fault_schedule(seed: int, n: int, gap_s: tuple[float, float]) -> list[tuple[float, str]]:
    """The first n (wait seconds, fault kind) pairs of the seed's schedule: each wait counts from the previous
    fault's recovery. Every kind comes once per round of len(KINDS) faults (a shuffled round), so a short run
    still meets each kind and a long one meets each kind about equally."""
    rng = random.Random(seed)
    out: list[tuple[float, str]] = []
    while len(out) < n:
        kinds = list(KINDS)
        rng.shuffle(kinds)
        out += [(round(rng.uniform(*gap_s), 1), k) for k in kinds]
    return out[:n]


class Chaos:
    """Injects one fault of a kind into the running job; bench reliability's and bench node_loss's injectors
    do the killing, the Serve controller is found here."""

    def __init__(self, cfg, cluster, run_dir: Path, rng: random.Random):
        self.procs = Injector(cfg, run_dir, [], 0, 0)
        self.nodes = NodeKiller(cluster, run_dir, [], 0, 0)
        self.cluster, self.rng = cluster, rng

    def step(self) -> int:
        return self.procs._step()

    def inject(self, kind: str) -> dict:
        if kind == "controller":
            found = [a for a in _alive_actors("ServeController") if a.get("pid")]
            if not found:
                raise LookupError("no live ServeController actor")
            _kill_pid(found[0]["pid"])
            return {"victim": f"ServeController {found[0]['name']}", "pid": found[0]["pid"]}
        if kind == "node":  # the node of a replica or of a train worker (both nodes hold one or the other)
            rec = self.nodes.inject(self.rng.choice(["replica", "train_worker"]))
            self.cluster.add_node(num_cpus=NODE_CPUS)  # capacity returns before the next fault
            self.cluster.wait_for_nodes()
            return {"victim": f"node {rec['node']} ({', '.join(rec['held'])}); a node added back", **rec}
        if kind == "replica":
            return self._replica()
        return self.procs.inject(kind)

    def _replica(self) -> dict:
        """The busiest replica by the ingress's stats (bench reliability's way); when the stats call fails, a
        RolloutReplica actor by class, and the stats error is kept in the record (a finding, not a skip)."""
        try:
            return self.procs.inject("replica")
        except Exception as e:
            found = [a for a in _alive_actors("RolloutReplica") if a.get("pid")]
            if not found:
                raise
            _kill_pid(found[0]["pid"])
            return {"victim": f"vLLM replica {found[0]['name']} (by actor class)", "pid": found[0]["pid"],
                    "stats_error": _short(e)}


def _short(e: Exception) -> str:
    """An exception as one readable string (Ray's tracebacks carry terminal colours)."""
    return re.sub(r"\x1b\[[0-9;]*m", "", f"{type(e).__name__}: {e}")[:2000]


def _wait_step_after(chaos: Chaos, step: int, proc, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if chaos.step() > step:
            return True
        time.sleep(0.3)
    return chaos.step() > step


def _sleep_while_running(proc, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end and proc.poll() is None:
        time.sleep(0.5)


def inject_faults(chaos: Chaos, proc, schedule, minutes: float, t0: float) -> list[dict]:
    """The main thread's loop: fault after fault for `minutes` from the run's first step, or until it ends."""
    log: list[dict] = []
    if not _wait_step_after(chaos, 0, proc, RECOVERY_TIMEOUT_S):  # a first step: the run is up
        return log
    fault_until = time.monotonic() + minutes * 60  # start-up (~1-2 min) is not soak time
    for wait_s, kind in schedule:
        _sleep_while_running(proc, wait_s)
        if proc.poll() is not None or time.monotonic() > fault_until:
            break
        rec: dict = {"kind": kind, "after_s": round(time.monotonic() - t0, 1), "waited_s": wait_s,
                     "step": chaos.step()}
        t = time.monotonic()
        try:
            rec.update(chaos.inject(kind), injected=True)
        except Exception as e:
            if proc.poll() is not None:  # the run ended meanwhile: nothing left to kill
                break
            rec.update(injected=False, reason=_short(e))
            log.append(rec)
            continue
        survived = _wait_step_after(chaos, rec["step"], proc, RECOVERY_TIMEOUT_S)
        rec.update(survived=survived, recovery_s=round(time.monotonic() - t, 1))
        log.append(rec)
        print(f"  fault {len(log):2d} {kind:<14} at {rec['after_s']:6.0f}s step {rec['step']:3d}: "
              f"{'recovered' if survived else 'NOT recovered'} in {rec['recovery_s']:.1f}s", flush=True)
        if not survived:
            break
    return log


def _z(rows: list[dict]) -> float | None:
    from common.stats import proportion_z

    k = len(rows) // 4
    return round(proportion_z(rows[:k], rows[-k:], PER_STEP * GROUP), 2) if k else None


def soak(work: Path, model: Path, minutes: float, seed: int, step_s: float, gap_s: tuple[float, float],
         prompts: int) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    from common import config as C

    steps = max(8, int(minutes * 60 / step_s))
    sets = [f"model.path={model}", "model.build_tiny=false", f"run.out_dir={work}", "run.name=chaos",
            f"train.total_steps={steps}", "checkpoint.every=4", f"data.builtin_size={prompts}",
            f"grpo.prompts_per_step={PER_STEP}", f"grpo.group_size={GROUP}", "eval.path=null",
            f"rollout.http_port={free_port()}", "rollout.proxy_location=HeadOnly",  # the nodes share one machine
            "run.stall_timeout_s=600", "run.placement_timeout_s=600",
            # The recipe's lr (3e-3, no KL) is tuned for 80 steps; over ~1,500 steps on 128 prompts the policy
            # collapsed (seed 1, second run: reward 0.9 at step 301, then 0 with entropy 0 from step ~335).
            # A soak measures recovery, so it trains the way a long run should: a third of the lr, anchored
            # to the base policy.
            f"grpo.lr={SOAK_LR}", f"grpo.kl_coef={SOAK_KL}"]
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(WORKER_NODES):
        cluster.add_node(num_cpus=NODE_CPUS)
    cluster.wait_for_nodes()
    sets.append(f"run.ray_address={cluster.address}")
    cfg = C.load(str(REPO / "recipes" / "tiny-cpu.yaml"), sets)
    run_dir = work / "chaos"
    out: dict = {"config": {"minutes": minutes, "seed": seed, "steps": steps, "step_s_assumed": step_s,
                            "gap_s": list(gap_s), "prompts": prompts, "prompts_per_step": PER_STEP, "group_size": GROUP,
                            "checkpoint_every": 4, "lr": SOAK_LR, "kl_coef": SOAK_KL,
                            "nodes": f"head (0 CPU) + {WORKER_NODES} x {NODE_CPUS} CPU",
                            "replicas": cfg.rollout.replicas, "rollout_workers": cfg.rollout.workers,
                            "train_workers": cfg.train.num_workers}}
    ray.init(address=cluster.address, log_to_driver=False)  # this process's view: actors, Serve handles
    cli = ["--config", str(REPO / "recipes" / "tiny-cpu.yaml"), *[a for s in sets for a in ("--set", s)]]
    t0 = time.monotonic()
    proc = _train_proc(cli, work / "train.log")
    try:
        chaos = Chaos(cfg, cluster, run_dir, random.Random(seed))
        schedule = fault_schedule(seed, 1000, gap_s)
        out["faults"] = inject_faults(chaos, proc, schedule, minutes, t0)
        out["faults_stopped_after_s"] = round(time.monotonic() - t0, 1)
        rc = proc.wait(timeout=max(600.0, minutes * 60))
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"[:500]
        rc = proc.poll()
    finally:
        _end_group(proc)
        ray.shutdown()
        cluster.shutdown()
    out["wall_seconds"] = round(time.monotonic() - t0, 1)
    out["exit_code"] = rc
    summary_f = run_dir / "summary.json"
    out["completed"] = rc == 0 and summary_f.is_file()
    if not out["completed"]:
        out["log_tail"] = (work / "train.log").read_text(errors="replace")[-3000:]
    buf = json.loads(summary_f.read_text()).get("buffer") or {} if summary_f.is_file() else {}
    rows = sorted({r["step"]: r for r in _rows(run_dir)}.values(), key=lambda r: r["step"])
    out["data"] = data_accounting(_rows(run_dir), prompts, PER_STEP, GROUP, steps,
                                  (buf.get("prompts") or {}).get("pending"))
    out["steps_completed"] = len(rows)
    out["reward_z"] = _z(rows)
    out["reward"] = [[r["step"], r.get("reward_mean")] for r in rows]
    return out


ZERO = ("samples_lost", "samples_doubled", "prompts_replayed", "prompts_skipped", "step_rows_missing",
        "step_rows_duplicated")


def table(res: dict) -> str:
    lines = [f"{'#':>3} {'kind':<15} {'at s':>6} {'step':>5} {'recovery s':>11}  victim"]
    for i, f in enumerate(res.get("faults", []), 1):
        rec = f"{f['recovery_s']:.1f}" if f.get("injected") else "not injected"
        if f.get("injected") and not f.get("survived"):
            rec += " (NOT)"
        lines.append(f"{i:>3} {f['kind']:<15} {f['after_s']:>6.0f} {f['step']:>5} {rec:>11}  "
                     f"{(f.get('victim') or f.get('reason') or '')[:60]}")
    d = res.get("data", {})
    lines.append("accounting: " + ", ".join(f"{k} {d.get(k)}" for k in ZERO))
    lines.append(f"steps {res.get('steps_completed')} of {res['config']['steps']}, completed {res.get('completed')}, "
                 f"reward z {res.get('reward_z')}, wall {res.get('wall_seconds')} s")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    pts = [(s, r) for s, r in res.get("reward", []) if r is not None]
    a.plot([s for s, _ in pts], [r for _, r in pts], lw=1, color="tab:blue")
    faults = [f for f in res.get("faults", []) if f.get("injected")]
    for f in faults:
        a.axvline(f["step"], color="tab:red", lw=0.8, alpha=0.6)
        a.text(f["step"], 1.0, f["kind"], rotation=90, fontsize=7, va="top", ha="right", color="tab:red")
    a.set(xlabel="step", ylabel="reward_mean", ylim=(0, 1.05),
          title=f"chaos soak: reward per step (z = {res.get('reward_z')}), faults in red")
    b.bar(range(1, len(faults) + 1), [f["recovery_s"] for f in faults], color="tab:orange")
    b.set_xticks(range(1, len(faults) + 1), [f["kind"] for f in faults], rotation=70, fontsize=7)
    b.set(ylabel="seconds", title="recovery: fault -> next step logged")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=20.0, help="minutes of faults (the run is sized to last them)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="3 minutes, faults every 20-40 s (at least two)")
    p.add_argument("--step-s", type=float, default=0.8,  # measured 0.88 s with faults on the 2-core machine
                   help="seconds a step takes with faults, to size total_steps so the run outlasts M minutes")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args(argv)
    from app.tiny_model import ensure_model

    minutes, gap = (3.0, (20.0, 40.0)) if args.quick else (args.minutes, (30.0, 90.0))
    with tempfile.TemporaryDirectory(prefix="chaos-") as tmp:
        work = Path(tmp)
        model = ensure_model(work / "tiny-model")
        res = soak(work, Path(model), minutes, args.seed, args.step_s, gap, prompts=128)
    res.update(machine=f"{platform.machine()}, {os.cpu_count()} cores", command=" ".join(
        ["python -m app bench chaos", *(["--quick"] if args.quick else ["--minutes", f"{args.minutes:g}"]),
         "--seed", str(args.seed)]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "chaos_quick" if args.quick else "chaos"
    (out / f"{name}.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    plot(res, out / f"{name}.png")
    print(table(res))
    print(f"wrote {out / name}.json, .png")
    ok = res.get("completed") and all(res["data"].get(k) == 0 for k in ZERO)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
