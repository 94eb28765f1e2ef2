"""AdapterSlots policy without an engine (fast): the standalone run "" as before runs existed, and per-run
quotas on a fleet (a run evicts only its own versions)."""
import pytest

from serve_deployments.adapter_slots import AdapterKey, AdapterSlots, SlotsFullError


def test_evicts_oldest_idle_never_in_use():
    s = AdapterSlots(3)
    for v in (1, 2, 3):
        assert s.victim() is None
        s.add(v, f"/p{v}", f"d{v}")
    s.acquire(1)
    assert s.victim() == ("", 2)  # 1 is oldest but in use
    s.acquire(2)
    s.acquire(3)
    with pytest.raises(SlotsFullError, match="in flight"):
        s.victim()
    s.release(3)
    assert s.victim() == ("", 3)
    s.release(1)
    assert s.victim() == ("", 1) and s.ongoing() == 1
    assert s.versions() == [1, 2, 3] and s.quota("") == 3 and s.quotas() == {}


def test_name_never_reused_for_other_weights():
    s = AdapterSlots(2)
    s.add(4, "/a", "aaa")
    s.remove(4)
    s.add(4, "/b", "aaa")  # same weights again: fine
    s.remove(4)
    with pytest.raises(ValueError, match="never reused"):
        s.add(4, "/c", "bbb")
    s.set_quota("x", 1)
    s.add(4, "/c", "bbb", run="x")  # another run's policy-v4 is another adapter
    with pytest.raises(ValueError, match="x/policy-v4"):
        s.check_digest(4, "ccc", run="x")


def fleet(capacity=6, **quotas):
    s = AdapterSlots(capacity)
    s.set_quota("", 0)
    for run, n in quotas.items():
        s.set_quota(run, n)
    return s


def test_a_run_evicts_only_its_own_versions():
    s = fleet(a=2, b=3)
    s.add(1, "/b1", "b1", run="b")
    for v in (1, 2):
        assert s.victim("a") is None
        s.add(v, f"/a{v}", f"a{v}", run="a")
    # At its quota with slots free overall: a's oldest idle, never b's (which is older).
    assert s.victim("a") == AdapterKey("a", 1)
    s.acquire(1, "a")
    assert s.victim("a") == ("a", 2)
    s.acquire(2, "a")
    with pytest.raises(SlotsFullError, match="run a"):
        s.victim("a")  # b's idle slot is not a's to take
    assert s.victim("b") is None
    assert s.versions("a") == [1, 2] and s.versions("b") == [1] and s.versions() == []
    assert s.keys() == [("a", 1), ("a", 2), ("b", 1)]
    assert s.ongoing("a") == 2 and s.ongoing("b") == 0 and s.inflight_of(2, "a") == 1


def test_a_run_without_quota_gets_no_slot():
    s = fleet(a=2)
    with pytest.raises(SlotsFullError, match="quota 0"):
        s.victim("b")
    with pytest.raises(SlotsFullError, match="quota 0"):
        s.victim("")  # the standalone run on a fleet
    with pytest.raises(ValueError, match="0..6"):
        s.set_quota("a", 7)


def test_under_quota_takes_back_a_shrunk_runs_idle_excess():
    s = fleet(4, a=2, b=2)
    for v in (1, 2):
        s.add(v, f"/a{v}", f"a{v}", run="a")
    s.set_quota("a", 4)  # a grows, fills the replica, then shrinks back
    for v in (3, 4):
        s.add(v, f"/a{v}", f"a{v}", run="a")
    s.set_quota("a", 2)
    s.acquire(3, "a")
    # b is under its quota but every slot is full: the oldest idle of the run over its quota goes.
    assert s.victim("b") == ("a", 1)
    s.remove(1, "a")
    s.add(1, "/b1", "b1", run="b")
    s.acquire(2, "a")
    s.acquire(4, "a")
    with pytest.raises(SlotsFullError, match="under its quota"):
        s.victim("b")  # a is still over (3 > 2) but everything of it is busy
    s.release(4, "a")
    assert s.victim("b") == ("a", 4)
    assert s.victim("a") == ("a", 4)  # a itself at/over its quota: its own oldest idle


def test_forget_drops_quota_and_digests():
    s = fleet(a=2, b=2)
    s.add(1, "/a1", "a1", run="a")
    with pytest.raises(ValueError, match="evict them first"):
        s.forget("a")
    s.remove(1, "a")
    s.forget("a")
    assert s.quota("a") == 0 and "a" not in s.quotas() and s.digest(1, "a") is None
    s.set_quota("a", 2)
    s.add(1, "/a1", "other weights", run="a")  # a later run of that name is another run
    assert s.quotas() == {"": 0, "a": 2, "b": 2}
