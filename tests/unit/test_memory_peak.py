"""fsdp8/app/bench/memory_peak.py's replay of an allocator trace, on hand-made events."""

from fsdp8.app.bench.memory_peak import format_peak, live_at_peak


def _alloc(addr, size, name):
    return {"action": "alloc", "addr": addr, "size": size, "frames": [{"filename": "/x/fsdp8/engine/unit.py",
                                                                       "line": 1, "name": name}]}


def _free(addr, size):
    return {"action": "free_completed", "addr": addr, "size": size}


def test_the_peak_and_what_is_alive_then():
    events = [_alloc(1, 100, "a"), _alloc(2, 50, "b"), {"action": "free_requested", "addr": 1, "size": 100},
              _free(1, 100), _alloc(3, 120, "c"), _free(99, 30),  # a block from before the step
              _alloc(4, 10, "d"), _free(3, 120)]
    peak, live = live_at_peak(events, baseline=1000)
    # 1000 +100 +50 -100 +120 = 1170 (then -30 +10 = 1150 never beats it)
    assert peak == 1170 and sorted(e["addr"] for e in live) == [2, 3]
    text = format_peak("t", peak, live, 1000)
    assert "unit.py:1 c" in text.splitlines()[4] and "unit.py:1 b" in text.splitlines()[5]
