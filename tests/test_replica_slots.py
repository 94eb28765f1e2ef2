"""AdapterSlots policy without an engine (fast)."""
import pytest

from serve_deployments.adapter_slots import AdapterSlots, SlotsFullError


def test_evicts_oldest_idle_never_in_use():
    s = AdapterSlots(3)
    for v in (1, 2, 3):
        assert s.victim() is None
        s.add(v, f"/p{v}", f"d{v}")
    s.acquire(1)
    assert s.victim() == 2  # 1 is oldest but in use
    s.acquire(2)
    s.acquire(3)
    with pytest.raises(SlotsFullError, match="in flight"):
        s.victim()
    s.release(3)
    assert s.victim() == 3
    s.release(1)
    assert s.victim() == 1 and s.ongoing() == 1


def test_name_never_reused_for_other_weights():
    s = AdapterSlots(2)
    s.add(4, "/a", "aaa")
    s.remove(4)
    s.add(4, "/b", "aaa")  # same weights again: fine
    s.remove(4)
    with pytest.raises(ValueError, match="never reused"):
        s.add(4, "/c", "bbb")
