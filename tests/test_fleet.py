"""Many runs, one fleet (docs/FLEET.md), end to end on CPU with real Ray, Serve, vLLM and DeepSpeed.

A fleet is started on a Ray cluster this test owns (`ray.cluster_utils.Cluster`), like `python -m app fleet up`
on a cluster of `ray start`. Two training runs with different LoRA ranks attach to it as separate driver
processes (`python -m app train --fleet NAME`, as a user starts them) and train at once: run b the tiny recipe, run a
the features a run brings to a shared fleet of its own accord (a verifiers multi-turn environment's episodes, a judge
asking the fleet's base model through the fleet's ingress, partial rollouts carried across versions), each seen
working in its rows (its step 1 also shows the trainer's logprobs equal to the fleet engine's, turn by turn: the
multi-turn environment's only real run in the suite). Then:
- a third attach that does not fit the fleet's adapter slots is refused at once, with the numbers;
- a run's token cannot unload another run's adapter (403);
- reading (/v1/models, a run's card, a replica's own REST port) needs the fleet's read token or a run's own
  (401 otherwise);
- one run's driver is SIGKILLed mid-run: its adapters leave /v1/models within the lease;
- each attached run is a row of the dashboard's Serve view (its card, `fleet-t.run.RUN` at /runs/RUN) while it
  holds a lease, and not after;
- the other run finishes every step and learns (reward z > 3).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from app.report import read_rows
from common import config as C
from common.stats import proportion_z
from tests._serve_helpers import LOGPROB_TOL, free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
# The project and run a's environment (tests/support/vf_steps_env.py), for the drivers and the cluster's nodes.
PYTHONPATH = os.pathsep.join([str(REPO), str(REPO / "tests" / "support")])
FLEET = "t"
ADMIN = "fleet-admin-token"
READ = "fleet-read-token"  # reading (REST completions, /v1/models, the run cards) needs it
LEASE_S = 10.0
SLOTS = 10  # two runs of max_staleness + 2 = 4 slots, and a probe run of 2: full
STEPS_B = 40  # z was 3.6 at 32 steps: margin over the z > 3 bar


def _rows(path: Path) -> list[dict]:
    return read_rows(path)[0]  # a line being written is skipped


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, tmp_path_factory):
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from app.fleet import fleet_down, fleet_up

    # Run a's environment (tests/support/vf_steps_env.py) is installed on the cluster's nodes, as a user's would be:
    # the cluster's processes, started here, inherit the path.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", PYTHONPATH)
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": False})
    port = free_port()
    cfg = C.load("recipes/tiny-cpu.yaml", [
        f"model.path={tiny_model_dir}", "model.build_tiny=false", "rollout.replicas=1", f"rollout.http_port={port}",
        "rollout.proxy_location=HeadOnly", f"sync.max_loras={SLOTS}", "rollout.max_lora_rank=8",
        "rollout.cpus_per_replica=0.5", "rollout.replica_http_port=0"])
    try:  # from here on the cluster goes down whatever fails (a cluster left up outlives the test session)
        ray.init(address=cluster.address, log_to_driver=False)
        out = fleet_up(cfg, FLEET, SLOTS, LEASE_S, admin_token=ADMIN, read_token=READ)
        yield {"address": cluster.address, "port": port, "out": tmp_path_factory.mktemp("fleet"), **out}
        fleet_down(FLEET, ADMIN)
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


# Run a: vf_steps_env (tests/support), 3 turns; the judge reads only the reply (the environment's rows have no
# answer column); partial rollouts with policy all, so every episode in flight moves when a version goes live.
FEATURES_A = ["env.verifiers=vf_steps_env", 'env.args={"size": 32, "turns": 3}', "env.max_turns=3",
              "grpo.prompts_per_step=2", "grpo.group_size=4", "rollout.partial=true", "rollout.partial_policy=all",
              "reward.judge.template=Reply Y or N. The reply was: {completion}",
              'reward.judge.parse={"kind": "words", "yes": ["Y"], "no": ["N"]}', "reward.judge.weight=0.5",
              "reward.judge.max_tokens=2", "reward.judge.temperature=0.0"]


def _start_run(fleet: dict, tiny_model_dir, name: str, rank: int, steps: int, config: str = "recipes/tiny-cpu.yaml",
               extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, Path]:
    out = fleet["out"]
    log = open(out / f"{name}.log", "w")
    cmd = [sys.executable, "-m", "app", "train", "--config", config, "--fleet", FLEET,
           "--no-progress", "--set", f"model.path={tiny_model_dir}", "--set", "model.build_tiny=false",
           "--set", f"run.name={name}", "--set", f"run.out_dir={out}", "--set", f"lora.rank={rank}",
           "--set", f"lora.alpha={2 * rank}", "--set", f"train.total_steps={steps}", "--set", "train.num_workers=1",
           "--set", "rollout.workers=1", "--set", "checkpoint.every=0", "--set", "eval.path=null",
           *[a for s in extra for a in ("--set", s)]]
    env = dict(os.environ, RAY_ADDRESS=fleet["address"], LORA_GRPO_FLEET_TOKEN=ADMIN, PYTHONPATH=PYTHONPATH)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, out / name / "metrics.jsonl"


def _model_ids(base: str) -> set[str]:
    r = httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {READ}"}, timeout=30)
    assert r.status_code == 200, r.text
    return {m["id"] for m in r.json()["data"]}


def _versions(ids: set[str], run: str) -> set[int]:
    """The N of every `RUN/policy-vN` listed: a run's live window moves on each step (max_staleness + 1 versions)."""
    prefix = f"{run}/policy-v"
    return {int(i[len(prefix):]) for i in ids if i.startswith(prefix) and i[len(prefix):].isdigit()}


def _wait(cond, timeout_s: float, what: str, procs=(), logs=()):
    """cond() until truthy; a run that exits meanwhile, or the timeout, fails with the tails of the runs' logs."""
    def tails() -> str:
        return "".join(f"\n--- {log.name} ---\n{log.read_text()[-2000:]}" for log in logs if log.exists())

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        for p in procs:
            assert p.poll() is None, f"a run exited ({p.returncode}) while waiting for {what}{tails()}"
        time.sleep(1.0)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}{tails()}")


def _serve_apps() -> dict:
    from ray import serve

    return serve.status().applications


def test_two_runs_share_a_fleet_one_killed_the_other_learns(fleet, tiny_model_dir):
    import ray

    from app.fleet import fleet_status
    from common.names import NAMESPACE, fleet_app
    from serve_deployments.fleet_state import FleetError
    from serve_deployments.run_card import RUN_INFIX, run_card_app

    base = f"http://127.0.0.1:{fleet['port']}"
    state = ray.get_actor(fleet_app(FLEET), namespace=NAMESPACE)
    logs = tuple(fleet["out"] / f"{n}.log" for n in "ab")
    a, a_rows = _start_run(fleet, tiny_model_dir, "a", rank=4, steps=400, config="recipes/verifiers-cpu.yaml",
                           extra=tuple(FEATURES_A))
    b = None
    try:
        # Run a goes first: its start (an environment, a judge) is the longer, and run b, which ends on its own,
        # has to outlast the checks below that need both runs attached, the kill of run a included.
        _wait(lambda: "a" in ray.get(state.runs.remote()), 300, "run a to attach", (a,), logs)
        b, b_rows = _start_run(fleet, tiny_model_dir, "b", rank=8, steps=STEPS_B)
        # Both train at once, each served under its own names, ranks 4 and 8 side by side. (Past their second
        # step: which versions are listed then is timing, since a run's live window moves on at each of its steps.)
        def both_past_v2():
            ids = _model_ids(base)
            return ids if all(max(_versions(ids, r), default=0) >= 2 for r in "ab") else None
        ids = _wait(both_past_v2, 600, "both runs to publish policy-v2 or later", (a, b), logs)
        assert {"a/policy-latest", "b/policy-latest"} <= ids
        runs = ray.get(state.runs.remote())
        assert {r: (v["slots"], v["lora_rank"]) for r, v in runs.items()} == {"a": (4, 4), "b": (4, 8)}

        # Each run is an application of the Serve view (the dashboard's rows), and its card answers at /runs/RUN.
        cards = {run_card_app(FLEET, "a"), run_card_app(FLEET, "b")}
        _wait(lambda: (lambda x: cards <= set(x) and all(x[c].status == "RUNNING" for c in cards))(_serve_apps()),
              120, "the runs' cards to run", (a, b), logs)
        card = httpx.get(f"{base}/runs/b", headers={"Authorization": f"Bearer {READ}"}, timeout=30).json()
        assert (card["run"], card["slots"], card["lora_rank"]) == ("b", 4, 8), card
        assert card["live_versions"] and card["models"][-1] == "b/policy-latest", card
        assert all(m.startswith("b/") for m in card["models"]) and card["tokens"] > 0, card

        # A probe run takes the last 2 slots; one more run needing 4 is refused at once, with the numbers.
        probe = ray.get(state.attach.remote(ADMIN, "probe", 2, 1.0, 4))
        with pytest.raises(FleetError) as e:
            ray.get(state.attach.remote(ADMIN, "d", 4, 1.0, 4))
        assert e.value.status_code == 409 and "needs 4 adapter slots" in str(e.value) and "0 of 10" in str(e.value)

        # Reading needs the read token (or a run's own): a card and /v1/models refuse anyone else, on the replica's
        # own port (rollout.replica_http_port) too, which serves every attached run's names.
        direct = fleet_status(FLEET)["replica_stats"][0]["http_url"]
        assert _versions({m["id"] for m in httpx.get(f"{direct}/models", timeout=30,
                                                     headers={"Authorization": f"Bearer {READ}"}).json()["data"]}, "b")
        for url in (f"{base}/runs/b", f"{base}/v1/models", f"{direct}/models"):
            assert httpx.get(url, timeout=30).status_code == 401
            assert httpx.get(url, headers={"Authorization": "Bearer wrong"}, timeout=30).status_code == 401
            assert httpx.get(url, headers={"Authorization": f"Bearer {probe['token']}"}, timeout=30).status_code == 200

        # A run's token may not unload another run's adapter; the fleet's admin token is not needed to see that.
        r = httpx.delete(f"{base}/admin/adapters/b/policy-v1", headers={"Authorization": f"Bearer {probe['token']}"},
                         timeout=30)
        assert r.status_code == 403, r.text
        assert _versions(_model_ids(base), "b"), "run b's adapters went with a refused unload"

        # Run a's features worked through the fleet: 3-turn episodes, token-exact turn by turn; the judge's score
        # (weight 0.5, in [0, 1]) added to the environment's rubric, every call answered by the fleet's base model;
        # partial rollouts on, an episode in flight moving to the version that went live (policy all; whether one
        # was in flight at a publish is timing: here 1 of run a's first 4 steps moved one; the move itself, token
        # exact on a fleet replica, is tests/test_partial_rollouts.py's TestOneFleetReplica). Read at the kill, so
        # run b is still training when run a goes.
        _wait(lambda: len(_rows(a_rows)) >= 2, 300, "two steps of run a", (a,), logs)
        rows_a = _rows(a_rows)
        moved = [r for r in rows_a if r.get("partial_resumed", 0) > 0]
        for r in rows_a:
            assert r["episode_turns_mean"] == 3.0 and r["retokenized_turns"] == 0, r
            rubric = 0.5 * r["reward/last_exact"] + 0.5 * r["reward/steps_right"]
            assert rubric - 1e-9 <= r["reward_mean"] <= rubric + 0.5 + 1e-9, r
            assert "versions_per_sample_mean" in r and "tokens_regenerated" in r, r
        assert all(r["versions_per_sample_mean"] > 1.0 for r in moved), moved
        # Step 1 scores the base weights its episodes were sampled under: the trainer's logprob of every sampled token
        # of every turn equals the fleet engine's, so what it trained on is the engine's ids, turn by turn.
        assert rows_a[0]["step"] == 1 and rows_a[0]["log_ratio_abs_max"] <= LOGPROB_TOL, rows_a[0]
        judged = [r["reward_judge"] for r in rows_a if r.get("reward_judge") is not None]
        assert judged and all(0.0 <= x <= 1.0 for x in judged), judged
        last = rows_a[-1]
        assert last["judge_calls"] >= 2 * 4 and last["judge_errors"] == 0 and last["judge_timeouts"] == 0, last

        # SIGKILL run a's driver: no detach; its lease runs out and the fleet unloads its adapters.
        a.send_signal(signal.SIGKILL)
        a.wait(timeout=30)
        t_kill = time.monotonic()
        # Gone from /v1/models at once (its registry died with its driver: nothing of it is offered), and from
        # every replica's slots once the lease ran out and the fleet forgot it.
        _wait(lambda: not any(i.startswith("a/") for i in _model_ids(base)), LEASE_S + 30,
              "run a's adapters to leave /v1/models")
        _wait(lambda: "a" not in ray.get(state.runs.remote()), LEASE_S + 30, "the fleet to forget run a")
        gone_s = time.monotonic() - t_kill
        assert gone_s <= LEASE_S + 30
        _wait(lambda: run_card_app(FLEET, "a") not in _serve_apps(), 60, "run a's card to leave the Serve view")
        assert run_card_app(FLEET, "b") in _serve_apps()
        held = [name for rep in fleet_status(FLEET)["replica_stats"] for name in rep["adapters"]]
        assert not any(name.startswith("a/") for name in held), held
        assert any(name.startswith("b/") for name in held), f"run b's adapters went with run a's: {held}"
        assert any(i.startswith("b/") for i in _model_ids(base))

        # Run b, untouched, finishes every step and learns.
        assert b.wait(timeout=900) == 0, (fleet["out"] / "b.log").read_text()[-3000:]
        rows = _rows(b_rows)
        assert [r["step"] for r in rows] == list(range(1, STEPS_B + 1))
        k = len(rows) // 4
        per_step = 16 * 8  # tiny-cpu: prompts_per_step x group_size
        z = proportion_z(rows[:k], rows[-k:], per_step)
        assert z > 3.0, f"run b did not learn: z={z:.2f}, {[round(r['reward_mean'], 3) for r in rows]}"
        # It detached at its end: its slots are free again, and its names gone.
        _wait(lambda: "b" not in ray.get(state.runs.remote()), 30, "run b to detach")
        assert not any(i.startswith("b/") for i in _model_ids(base))
        ray.get(state.detach.remote("probe", probe["token"]))
        _wait(lambda: not any(RUN_INFIX in name for name in _serve_apps()), 60, "every card to leave the Serve view")
        print(json.dumps({"a_gone_after_kill_s": round(gone_s, 1), "b_z": round(z, 2), "a_steps": len(rows_a),
                          "a_steps_with_a_move": len(moved)}))
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=30)
