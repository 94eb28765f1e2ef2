"""The driver's Ctrl-C handler with a real RolloutBuffer actor and real SIGINTs sent to this process:
the first asks the buffer to stop after the current step (the trainer reads it between steps) and
does not interrupt the driver; the second raises KeyboardInterrupt at once. `python -m app train`
turns that into exit 130 with teardown (the once-path end to end is tests/test_resume.py)."""
import os
import signal
import time

import pytest


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _wait_for(pred, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return False


def test_ctrl_c_once_requests_a_stop_twice_stops_at_once(ray_local):
    from app.buffer import RolloutBuffer
    from app.watch import CtrlC

    ray = ray_local
    buf = RolloutBuffer.remote(max_staleness=1, groups_per_step=2, rows=[])
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with CtrlC(buf) as ctrl_c:
            assert not ray.get(buf.stop_requested.remote())
            os.kill(os.getpid(), signal.SIGINT)
            # the first Ctrl-C only tells the buffer; the driver keeps waiting for the checkpoint
            assert _wait_for(lambda: ray.get(buf.stop_requested.remote()))
            assert ctrl_c.count == 1
            os.kill(os.getpid(), signal.SIGINT)
            _wait_for(lambda: False, timeout=5.0)  # the handler raises in this frame
            pytest.fail("the second Ctrl-C did not interrupt the driver")
    assert ctrl_c.count == 2
    assert signal.getsignal(signal.SIGINT) is before  # the handler is removed on the way out


def test_a_stopped_run_reports_the_buffers_counts_and_a_dead_buffer_does_not_fail_the_stop(ray_local):
    """driver.run's answer for a run stopped by Ctrl-C (or a benchmark's deadline) carries the buffer's counts
    (drops, groups dropped after a sample moved); a buffer that died with the run gives None, not an error."""
    from app.buffer import RolloutBuffer
    from app.driver import _buffer_stats

    ray = ray_local
    buf = RolloutBuffer.remote(max_staleness=1, groups_per_step=2, rows=[])
    stats = _buffer_stats(buf)
    assert stats["dropped_samples"] == 0 and stats["dropped_continued_groups"] == 0
    ray.kill(buf)
    # ray.kill only asks: a call sent right after it can still be answered (CI saw one), so wait for the death.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(buf.stats.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("the killed buffer still answers after 30 s")
    assert _buffer_stats(buf) is None
