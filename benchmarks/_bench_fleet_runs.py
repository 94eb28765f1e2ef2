"""benchmarks/bench_fleet.py's runs: what every run and the fleet share (Setup, the one-GPU fractions), one
driver subprocess `python -m app train` and its record (Run, run_record), the token shares polled from the
fleet while its runs go (Shares), and a group of runs started at once and waited for (run_group)."""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from app.report import read_rows
from common.ports import free_port

REPO = Path(__file__).resolve().parents[1]

FLEET = "bench"
ADMIN = "bench-fleet-admin-token"
LEASE_S = 30.0
POLL_S = 3.0  # fleet_status and progress lines; a run's end is caught at once by its own waiter thread
PROGRESS_S = 20.0
RUN_TIMEOUT_S = 3600.0  # per group of runs: a run that hangs fails the benchmark instead of blocking it
GPU_STEP = 0.05  # GPU fractions are multiples of this (Ray keeps resources to 1e-4; 0.05 reads well)


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
