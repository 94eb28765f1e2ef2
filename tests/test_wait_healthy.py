"""serve_deployments.app_builder.wait_healthy without Ray: a fake ingress handle whose `health` says not ready
a few times, and a fake clock, so the progress lines (every ~30 s, naming the health body's reason) and the
TimeoutError's text are checked in milliseconds."""
import types

import pytest

from serve_deployments import app_builder

NOT_READY = {"status": "starting", "reason": "1 replicas did not answer", "replicas_ready": 0, "replicas": 1,
             "live": ["policy-v1"], "missing_versions": {}}
MISSING = {"status": "starting", "reason": "live versions not loaded yet on 1 replicas", "replicas_ready": 0,
           "replicas": 1, "live": ["policy-v1"], "missing_versions": {"r0": ["policy-v1"]}}
READY = {"status": "ok", "reason": "ready", "replicas_ready": 1, "replicas": 1, "live": ["policy-v1"],
         "missing_versions": {}}


class FakeHandle:
    """`handle.health.remote().result()` answers the next of `answers` (the last one repeats)."""

    def __init__(self, answers):
        self.answers, self.calls = list(answers), 0
        self.health = types.SimpleNamespace(remote=self._remote)

    def _remote(self):
        answer = self.answers[min(self.calls, len(self.answers) - 1)]
        self.calls += 1
        return types.SimpleNamespace(result=lambda: answer)


@pytest.fixture
def clock(monkeypatch):
    """app_builder's `time` with a clock that only `sleep` moves."""
    now = [1000.0]
    fake = types.SimpleNamespace(monotonic=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    monkeypatch.setattr(app_builder, "time", fake)
    return now


def test_progress_lines_name_the_reason_and_the_ready_body_is_returned(clock):
    # 0.5 s apart: 70 answers not ready (35 s, one of them past 30 s), then 65 still missing a version, then ready.
    handle = FakeHandle([(False, NOT_READY)] * 70 + [(False, MISSING)] * 65 + [(True, READY)])
    lines = []
    body = app_builder.wait_healthy(handle, log=lines.append)
    assert body == READY and handle.calls == 136
    assert len(lines) == 2, lines  # at ~30 s and ~60 s, none once ready
    assert lines[0].startswith("service not ready after 30 s: 1 replicas did not answer"), lines
    assert "replicas_ready 0/1" in lines[0] and "missing_versions" not in lines[0]  # an empty one is left out
    assert lines[1].startswith("service not ready after 60 s: live versions not loaded yet on 1 replicas"), lines
    assert "missing_versions {'r0': ['policy-v1']}" in lines[1]


def test_default_log_prints_flushed(clock, capsys):
    handle = FakeHandle([(False, NOT_READY)] * 5 + [(True, READY)])
    assert app_builder.wait_healthy(handle, interval_s=1.0, progress_s=2.0) == READY
    out = capsys.readouterr().out.splitlines()
    assert out == ["service not ready after 2 s: 1 replicas did not answer (replicas_ready 0/1)",
                   "service not ready after 4 s: 1 replicas did not answer (replicas_ready 0/1)"]


def test_timeout_names_the_last_reason(clock):
    handle = FakeHandle([(False, NOT_READY)] * 3 + [(False, MISSING)])
    lines = []
    with pytest.raises(TimeoutError) as e:
        app_builder.wait_healthy(handle, timeout_s=10.0, progress_s=4.0, log=lines.append)
    msg = str(e.value)
    assert msg.startswith("service not healthy after 10s: live versions not loaded yet on 1 replicas"), msg
    assert "policy-v1" in msg
    assert [line.split(":")[0] for line in lines] == ["service not ready after 4 s", "service not ready after 8 s"]


def test_ready_at_once_logs_nothing(clock):
    lines = []
    assert app_builder.wait_healthy(FakeHandle([(True, READY)]), log=lines.append) == READY
    assert lines == []
