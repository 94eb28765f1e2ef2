"""cluster/gpu_mps.py: the CUDA MPS daemon's start and stop around a shared-GPU run. No GPU or NVIDIA driver
here, so `nvidia-cuda-mps-control` is a stand-in script on PATH that records how it was called (the real
one needs the driver); what is checked is this module's side: the flags, the pipe and log folders the
children inherit, the `quit` on exit, the environment put back, and the errors."""
import logging
import os
import stat

import pytest

from cluster.gpu_mps import MpsError, mps_daemon

STAND_IN = """#!/bin/sh
IN=""
if [ -z "$1" ]; then IN=$(cat | tr '\\n' ' '); fi
echo "argv=$* pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY stdin=$IN" >> "{calls}"
exit {rc}
"""


def _stand_in(tmp_path, monkeypatch, rc: int = 0):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "nvidia-cuda-mps-control"
    calls = tmp_path / "calls.txt"
    exe.write_text(STAND_IN.format(calls=calls, rc=rc))
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return calls


def test_daemon_started_children_see_it_quit_and_env_restored(tmp_path, monkeypatch):
    calls = _stand_in(tmp_path, monkeypatch)
    monkeypatch.setenv("CUDA_MPS_LOG_DIRECTORY", "/elsewhere")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    root = tmp_path / "mps"
    with mps_daemon(root) as env:
        assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == str(root / "pipe") == env["CUDA_MPS_PIPE_DIRECTORY"]
        assert os.environ["CUDA_MPS_LOG_DIRECTORY"] == str(root / "log")
        assert (root / "pipe").is_dir() and (root / "log").is_dir()
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ and os.environ["CUDA_MPS_LOG_DIRECTORY"] == "/elsewhere"
    start, stop = calls.read_text().splitlines()
    assert start.startswith(f"argv=-d pipe={root / 'pipe'} log={root / 'log'}"), start
    assert stop.startswith(f"argv= pipe={root / 'pipe'}") and stop.rstrip().endswith("stdin=quit"), stop


def test_daemon_quits_when_the_run_raises(tmp_path, monkeypatch):
    calls = _stand_in(tmp_path, monkeypatch)
    with pytest.raises(ZeroDivisionError):
        with mps_daemon(tmp_path / "mps"):
            raise ZeroDivisionError("the run failed")
    assert calls.read_text().splitlines()[-1].rstrip().endswith("stdin=quit")


def test_failing_or_missing_control_is_named(tmp_path, monkeypatch):
    _stand_in(tmp_path, monkeypatch, rc=3)
    with pytest.raises(MpsError, match=r"nvidia-cuda-mps-control -d failed \(exit 3\)"):
        with mps_daemon(tmp_path / "mps"):
            pass
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ or os.environ["CUDA_MPS_PIPE_DIRECTORY"] != str(
        tmp_path / "mps" / "pipe")
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    with pytest.raises(MpsError, match="not on PATH"):
        with mps_daemon(tmp_path / "mps2"):
            pass


def test_probe_runs_as_first_client_and_a_failing_one_stops_the_daemon(tmp_path, monkeypatch):
    """The probe sees the daemon's pipe folder; when it fails, the daemon gets its `quit` and the caller's
    block never runs (a pipeline run would otherwise fail minutes in, inside a Ray worker)."""
    import sys

    calls = _stand_in(tmp_path, monkeypatch)
    root = tmp_path / "mps"
    seen = tmp_path / "seen.txt"
    ok = [sys.executable, "-c", f"import os; open({str(seen)!r}, 'w').write(os.environ['CUDA_MPS_PIPE_DIRECTORY'])"]
    with mps_daemon(root, probe=ok):
        pass
    assert seen.read_text() == str(root / "pipe")
    ran = []
    bad = [sys.executable, "-c", "import sys; sys.stderr.write('cudaErrorMpsConnectionFailed'); sys.exit(4)"]
    with pytest.raises(MpsError, match=r"first client failed \(exit 4: cudaErrorMpsConnectionFailed\)"):
        with mps_daemon(tmp_path / "mps2", probe=bad):
            ran.append(1)
    assert not ran and "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
    assert calls.read_text().splitlines()[-1].rstrip().endswith("stdin=quit")


def test_without_the_control_binary_mps_is_off_in_one_line_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
    from cluster.gpu_mps import mps_for_run, mps_if_supported
    from common import config as C

    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    said = []
    with mps_if_supported(tmp_path / "mps", say=said.append) as env:
        assert env is None and "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
    assert said == ["CUDA MPS off: nvidia-cuda-mps-control is not on PATH: CUDA MPS needs the NVIDIA driver's "
                    "utilities on this node; the trainer and the replica time-slice the GPU"]

    # `app train` with the GPU recipe (train.mps: true): the same one line on the console's logger.
    with caplog.at_level(logging.INFO, logger="app"):
        with mps_for_run(C.load("recipes/gpu-1x.yaml")) as env:
            assert env is None
        with mps_for_run(C.load("recipes/gpu-1x.yaml", ["train.mps=false"])) as env:  # off: nothing said
            assert env is None
    assert [r.getMessage() for r in caplog.records if "CUDA MPS" in r.getMessage()] == [said[0]]


def test_a_daemon_that_serves_no_client_is_quit_and_named(tmp_path, monkeypatch):
    """The stand-in daemon starts, but the CUDA probe (a real torch process) finds no GPU here: the daemon is
    quit and the one line says why, with the probe's error."""
    from cluster.gpu_mps import mps_if_supported

    calls = _stand_in(tmp_path, monkeypatch)
    said = []
    with mps_if_supported(tmp_path / "mps", say=said.append) as env:
        assert env is None
    (line,) = said
    assert line.startswith("CUDA MPS off: the MPS daemon started but its first client failed (exit 1: ")
    assert calls.read_text().splitlines()[-1].rstrip().endswith("stdin=quit")


def test_the_gpu_recipe_and_the_pipeline_benchmark_default_to_the_measured_best():
    """BENCHMARKS.md section 14's best: MPS, rollout.max_num_seqs 512, CUDA graphs; a plain run reproduces it."""
    from benchmarks.gpu_pipeline import PIPELINE_DEFAULT_SETS, parse_args
    from common import config as C

    cfg = C.load("recipes/gpu-1x.yaml")
    assert (cfg.train.mps, cfg.rollout.max_num_seqs, cfg.rollout.enforce_eager) == (True, 512, False)
    assert C.load("recipes/gpu-2x.yaml").rollout.enforce_eager is False
    args = parse_args([])
    assert args.mps is True and args.pipeline_set == ["rollout.max_num_seqs=512"] == list(PIPELINE_DEFAULT_SETS)
    assert C.load("recipes/gpu-1x.yaml", args.pipeline_set).rollout.max_num_seqs == 512
    args = parse_args(["--no-mps", "--pipeline-set", "rollout.max_num_seqs=256"])
    assert args.mps is False and C.load("recipes/gpu-1x.yaml", args.pipeline_set).rollout.max_num_seqs == 256
