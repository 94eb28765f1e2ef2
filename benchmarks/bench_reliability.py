"""Reliability: faults injected from outside into real runs on CPU, and what survived.

    python -m app bench reliability            # ~6-10 min on the 2-core machine
    python -m app bench reliability --quick    # fewer steps (smoke)

1. One training run (the tiny recipe, shortened; 2 vLLM replicas, 2 rollout workers, 2 train workers)
   with four processes SIGKILLed while it trains, one after the other once the previous fault was
   survived (a step finished after it): a vLLM replica, the router ingress, a rollout worker, a train
   worker (Ray Train restores the group from the last checkpoint). Then, on the same service (kept up),
   the hostile REST cases (benchmarks/hostile_cases.py, shared with tests/test_hostile_rest.py) by status,
   a body over the size limit, and a burst of concurrent good requests (load held: every request answered,
   no 5xx).
2. The driver SIGKILLed (`python -m app train` as a subprocess) after its first checkpoint, then
   `--resume RUN_DIR` to the end.
For both: samples lost or doubled (every step has prompts_per_step groups of group_size samples), prompts
replayed (trained twice in an epoch) or skipped (never trained in an epoch that was finished), metric
rows duplicated or missing. Writes benchmarks/results/reliability.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from common.data_accounting import data_accounting
from common.ports import free_port
from common.processes import descendant_pids

REPO = Path(__file__).resolve().parents[1]


def _rows(run_dir: Path) -> list[dict]:
    f = run_dir / "metrics.jsonl"
    out = []
    if f.is_file():
        for line in f.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


# ---------------------------------------------------------------- 1. one run, four faults, then REST

def _alive_actors(cls_part: str) -> list[dict]:
    """This cluster's live actors whose class name contains `cls_part` (the GCS of the connected driver:
    other Ray instances on the machine are not looked at)."""
    import ray
    from ray._private import state
    from ray.util.state import list_actors

    found = [{"class_name": a.get("ActorClassName") or "", "name": a.get("Name") or "", "pid": a.get("Pid"),
              "actor_id": a.get("ActorID") or ""}
             for a in state.actors().values()
             if a.get("State") == "ALIVE" and cls_part in f"{a.get('ActorClassName') or ''} {a.get('Name') or ''}"]
    if not found:  # the state API of this cluster (its GCS address: other Ray instances run on the machine)
        def f(a, k):
            return (a.get(k) if isinstance(a, dict) else getattr(a, k, None)) or ""

        found = [{"class_name": f(a, "class_name"), "name": f(a, "name"), "pid": f(a, "pid") or None,
                  "actor_id": f(a, "actor_id")}
                 for a in list_actors(address=ray.get_runtime_context().gcs_address, limit=10000,
                                      filters=[("state", "=", "ALIVE")], raise_on_missing_output=False)
                 if cls_part in f"{f(a, 'class_name')} {f(a, 'name')}"]
    return found


def _kill_pid(pid: int) -> None:
    os.kill(int(pid), signal.SIGKILL)


class Injector(threading.Thread):
    """Watches the run's metrics rows; kills one process per fault, each once the previous one was
    survived (a step logged after it). Records when each fault was injected and survived."""

    def __init__(self, cfg, run_dir: Path, faults: list[str], first_step: int, gap: int):
        super().__init__(daemon=True)
        self.cfg, self.run_dir, self.faults = cfg, run_dir, faults
        self.first_step, self.gap = first_step, gap
        self.log: list[dict] = []
        self.stop = threading.Event()

    def _step(self) -> int:
        rows = _rows(self.run_dir)
        return max((r["step"] for r in rows), default=0)

    def _wait_step(self, n: int, timeout: float = 900) -> bool:
        deadline = time.monotonic() + timeout
        while not self.stop.is_set() and time.monotonic() < deadline:
            if self._step() >= n:
                return True
            time.sleep(0.3)
        return False

    def _victim(self, fault: str) -> dict:
        from ray import serve

        if fault == "replica":
            reps = serve.get_app_handle(self.cfg.rollout.app_name).stats.remote().result(timeout_s=30)["replicas"]
            busy = sorted(reps, key=lambda r: -int(r.get("ongoing", 0)))
            return {"pid": busy[0]["pid"], "what": f"vLLM replica {busy[0]['replica_id']}"}
        cls = {"router": "Ingress", "rollout_worker": "RolloutWorker", "train_worker": "RayTrainWorker"}[fault]
        if fault == "router":  # the ingress deployment's Serve replica process (deployment `Ingress`)
            title = f"ServeReplica:{self.cfg.rollout.app_name}:Ingress"
            pids = descendant_pids(title)
            if not pids:
                raise LookupError(f"no router ingress process found ({title})")
            return {"pid": pids[0], "what": f"router ingress ({title})"}
        found = [a for a in _alive_actors(cls) if a.get("pid")]
        if not found:
            names = sorted({a["class_name"] for a in _alive_actors("")})
            raise LookupError(f"no live {cls} actor; live classes: {names}")
        a = sorted(found, key=lambda a: a.get("name") or "")[-1]
        return {"pid": a["pid"], "what": f"{a.get('class_name')} {a.get('name') or a.get('actor_id', '')[:8]}"}

    def inject(self, fault: str) -> dict:
        """Inject one fault; returns what the record says of it (raises when it could not be injected)."""
        v = self._victim(fault)
        _kill_pid(v["pid"])
        return {"victim": v["what"], "pid": v["pid"]}

    def run(self) -> None:
        at = self.first_step
        for fault in self.faults:
            if not self._wait_step(at):
                self.log.append({"fault": fault, "injected": False, "reason": "run ended first"})
                continue
            rec: dict = {"fault": fault, "injected_after_step": self._step()}
            try:
                rec.update(self.inject(fault), injected=True, time=time.time())
            except Exception as e:
                rec.update(injected=False, reason=f"{type(e).__name__}: {e}"[:300])
                self.log.append(rec)
                continue
            t0 = time.monotonic()
            survived = self._wait_step(rec["injected_after_step"] + 1)
            rec.update(survived=survived, seconds_to_next_step=round(time.monotonic() - t0, 1))
            self.log.append(rec)
            at = rec["injected_after_step"] + self.gap


def rest_cases(url: str, model_dir: str, max_body: int) -> dict:
    import httpx

    from benchmarks.hostile_cases import CASES, EXPECTED, GOOD, materialize, openai_error_problem

    forbidden = sorted({str(model_dir), os.path.realpath(model_dir), os.getcwd(), "site-packages", "Traceback"})
    by_status: Counter = Counter()
    problems = []
    t0 = time.monotonic()
    with httpx.Client(base_url=url, timeout=60) as c:
        for name, method, path, kw in CASES:
            try:
                r = c.request(method, path, **materialize(kw, model_dir))
                status, text = r.status_code, r.text
            except httpx.HTTPError as e:
                status, text = 0, f"{type(e).__name__}"
            by_status[str(status)] += 1
            bad = openai_error_problem(status, text, forbidden, EXPECTED.get(name))
            if bad:
                problems.append({"case": name, "problem": bad})
        big = c.post("/v1/completions", content=b'{"prompt": "' + b"a" * (2 * max_body) + b'"}',
                     headers={"content-type": "application/json"})
        alive = c.post("/v1/completions", json=GOOD).status_code
    return {"cases": len(CASES), "by_status": dict(sorted(by_status.items())),
            "5xx": sum(v for k, v in by_status.items() if k.startswith("5")),
            "no_answer": by_status.get("0", 0), "problems": problems, "body_over_limit_status": big.status_code,
            "good_request_after": alive, "seconds": round(time.monotonic() - t0, 1)}


def load_burst(url: str, n: int) -> dict:
    import httpx

    from benchmarks.hostile_cases import GOOD

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=180,
                                     limits=httpx.Limits(max_connections=n, max_keepalive_connections=n)) as c:
            async def one():
                try:
                    r = await c.post("/v1/completions", json=GOOD)
                    return r.status_code, r.headers.get("retry-after")
                except httpx.HTTPError as e:
                    return type(e).__name__, None
            return await asyncio.gather(*[one() for _ in range(n)])

    t0 = time.monotonic()
    res = asyncio.run(go())
    codes = Counter(str(s) for s, _ in res)
    limited = [ra for s, ra in res if s in (429, 503)]
    return {"concurrent_requests": n, "by_status": dict(sorted(codes.items())),
            "answered": sum(v for k, v in codes.items() if k.isdigit()),
            "5xx": sum(v for k, v in codes.items() if k.startswith("5") and k != "503"),
            "limited_with_retry_after": sum(1 for ra in limited if ra), "limited": len(limited),
            "seconds": round(time.monotonic() - t0, 1)}


def run_with_faults(work: Path, model: Path, steps: int, prompts: int, quick: bool, sets: list[str]) -> dict:
    import ray

    from app import driver
    from benchmarks.hostile_cases import TOKEN
    from common import config as C

    port = free_port()
    max_body = 256 * 1024
    cfg = C.load(str(REPO / "recipes" / "tiny-cpu.yaml"), [
        f"model.path={model}", "model.build_tiny=false", f"run.out_dir={work}", "run.name=faults",
        f"train.total_steps={steps}", "checkpoint.every=3", f"data.builtin_size={prompts}", "grpo.prompts_per_step=8",
        "grpo.group_size=4", "grpo.max_new_tokens=24", "eval.path=null", f"rollout.http_port={port}",
        f"rollout.admin_token={TOKEN}",
        f"rollout.max_body_bytes={max_body}", "run.stall_timeout_s=600", *sets])
    faults = ["replica", "router", "rollout_worker", "train_worker"]
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false",
                                       "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "600"}})
    out: dict = {"config": {"steps": steps, "prompts": prompts, "prompts_per_step": 8, "group_size": 4,
                            "replicas": cfg.rollout.replicas, "rollout_workers": cfg.rollout.workers,
                            "train_workers": cfg.train.num_workers, "checkpoint_every": 3, "max_new_tokens": 24}}
    inj = Injector(cfg, work / "faults", faults, first_step=3, gap=3 if quick else 8)
    t0 = time.time()
    try:
        inj.start()
        try:
            summary = driver.run(cfg, keep_serving=True, progress=False)
            out["completed"] = True
            out["steps"] = summary["steps"]
        except Exception as e:
            out["completed"] = False
            out["error"] = f"{type(e).__name__}: {e}"[:500]
            summary = {}
        inj.stop.set()
        inj.join(timeout=5)
        out["wall_seconds"] = round(time.time() - t0, 1)
        out["faults"] = inj.log
        rows = _rows(work / "faults")
        out["data"] = data_accounting(rows, prompts, 8, 4, steps,
                                      ((summary.get("buffer") or {}).get("prompts") or {}).get("pending"))
        last = rows[-1] if rows else {}
        out["counters"] = {k: last.get(k, 0) for k in ("rollout_retries", "rollout_failed_groups",
                                                        "version_mismatches", "dropped_samples", "filtered_groups")}
        out["buffer"] = summary.get("buffer")
        if out["completed"]:
            url = f"http://127.0.0.1:{port}"
            try:
                from ray import serve

                out["router_admission"] = serve.get_app_handle(cfg.rollout.app_name).stats.remote().result(
                    timeout_s=30).get("admission")
            except Exception as e:
                out["router_admission"] = f"unavailable: {e}"[:200]
            out["rest_hostile"] = rest_cases(url, str(model), max_body)
            out["load"] = load_burst(url, 64 if quick else 300)
            driver.stop_serving(cfg.rollout.app_name)
    finally:
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return out


# ---------------------------------------------------------------- 2. driver SIGKILL + --resume


def _train_proc(args: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, RAY_ADDRESS="local")  # its own cluster, never one found running on the machine
    env.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.Popen([sys.executable, "-m", "app", "train", "--no-progress", *args], cwd=REPO, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def _end_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait(timeout=60)


def driver_kill_and_resume(work: Path, model: Path, steps: int, prompts: int, sets: list[str]) -> dict:
    from app.resume import find_checkpoint

    run_dir = work / "resume"
    per_step = 4
    cli = ["--config", str(REPO / "recipes" / "tiny-cpu.yaml")]
    for s in [f"model.path={model}", "model.build_tiny=false", f"run.out_dir={work}", "run.name=resume",
              f"train.total_steps={steps}", "checkpoint.every=2", f"data.builtin_size={prompts}",
              f"grpo.prompts_per_step={per_step}", "grpo.group_size=4", "eval.path=null", "rollout.replicas=1",
              "train.num_workers=1", f"rollout.http_port={free_port()}", *sets]:
        cli += ["--set", s]
    out: dict = {"config": {"steps": steps, "prompts": prompts, "prompts_per_step": per_step, "group_size": 4,
                            "checkpoint_every": 2}}
    t0 = time.time()
    p = _train_proc(cli, work / "first.log")
    try:
        deadline = time.monotonic() + 600
        while True:
            found = find_checkpoint(run_dir, 1)
            rows = _rows(run_dir)
            if found and any(r["step"] > found[1]["step"] for r in rows):
                break
            if p.poll() is not None or time.monotonic() > deadline:
                out["error"] = f"first run ended (rc {p.poll()}) before a step after its first checkpoint"
                return out
            time.sleep(0.3)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=60)
    finally:
        _end_group(p)
    killed_rows = _rows(run_dir)
    out["killed"] = {"checkpoint_step": found[1]["step"], "last_logged_step": max(r["step"] for r in killed_rows),
                     "rows_after_checkpoint_dropped_on_resume": sum(1 for r in killed_rows
                                                                     if r["step"] > found[1]["step"])}
    t1 = time.time()
    p = _train_proc(["--resume", str(run_dir)], work / "resume.log")
    try:
        rc = p.wait(timeout=900)
    finally:
        _end_group(p)
    out["resume_exit_code"] = rc
    out["resume_wall_seconds"] = round(time.time() - t1, 1)
    out["wall_seconds"] = round(time.time() - t0, 1)
    rows = _rows(run_dir)
    out["completed"] = rc == 0 and (run_dir / "summary.json").is_file()
    out["versions_continue"] = [r.get("version") for r in rows] == list(range(1, steps + 1))
    buf = {}
    if (run_dir / "summary.json").is_file():
        buf = json.loads((run_dir / "summary.json").read_text()).get("buffer") or {}
    out["data"] = data_accounting(rows, prompts, per_step, 4, steps, (buf.get("prompts") or {}).get("pending"))
    if rc != 0:
        out["error"] = (work / "resume.log").read_text()[-1500:]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer steps: a smoke check")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config overrides (both runs)")
    args = p.parse_args(argv)

    from app.tiny_model import ensure_model

    model = ensure_model(REPO / "runs" / "tiny-model")
    work = Path(tempfile.mkdtemp(prefix="bench-reliability-"))
    t0 = time.time()
    faults = run_with_faults(work, model, steps=16 if args.quick else 40, prompts=48, quick=args.quick,
                             sets=args.set)
    resume = driver_kill_and_resume(work, model, steps=6 if args.quick else 8, prompts=16, sets=args.set)

    survived = [f for f in faults.get("faults", []) if f.get("injected") and f.get("survived")]
    summary = {
        "faults_injected": sum(1 for f in faults.get("faults", []) if f.get("injected")) + int("killed" in resume),
        "faults_survived": len(survived) + int(bool(resume.get("completed"))),
        "runs_completed": int(bool(faults.get("completed"))) + int(bool(resume.get("completed"))),
        **{k: faults.get("data", {}).get(k, 0) + resume.get("data", {}).get(k, 0)
           for k in ("samples_lost", "samples_doubled", "prompts_replayed", "prompts_skipped",
                     "step_rows_duplicated", "step_rows_missing")},
        "rest_cases": (faults.get("rest_hostile") or {}).get("cases"),
        "rest_by_status": (faults.get("rest_hostile") or {}).get("by_status"),
        "rest_5xx": (faults.get("rest_hostile") or {}).get("5xx"),
        "load_answered": (faults.get("load") or {}).get("answered"),
        "load_requests": (faults.get("load") or {}).get("concurrent_requests"),
    }
    doc = {"benchmark": "reliability", "quick": args.quick, "command": "python -m app bench reliability"
           + (" --quick" if args.quick else ""), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "total_seconds": round(time.time() - t0, 1),
           "summary": summary, "run_with_faults": faults, "driver_kill_resume": resume}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("reliability_quick.json" if args.quick else "reliability.json")
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(json.dumps(summary, indent=2))
    print(f"wrote {path}")
    return 0 if summary["runs_completed"] == 2 else 1


if __name__ == "__main__":
    sys.exit(main())
