"""cluster/gpu_mps.py: the CUDA MPS daemon's start and stop around a shared-GPU run. No GPU or NVIDIA driver
here, so `nvidia-cuda-mps-control` is a stand-in script on PATH that records how it was called (the real
one needs the driver); what is checked is this module's side: the flags, the pipe and log folders the
children inherit, the `quit` on exit, the environment put back, and the errors."""
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
