"""``RemovalLog`` (kvtier.tiers.mooncake): which names the tier removed while a read was under
way. What it answers, and that keeping names for one long read costs the other reads nothing
per name kept (it rescanned every kept name at each read's end, under its lock: 14 ms a read
with 200,000 names kept beside one long read, and an erase quadratic; audit s30 a14 D1)."""

from __future__ import annotations

import time

from kvtier.tiers.mooncake import RemovalLog


def test_a_removal_overlapping_a_read_is_told_and_forgotten_once_no_read_can_ask():
    log = RemovalLog()
    with log.reading() as first:
        with log.removing(["a"]):
            assert log.overlapped("a", first)          # in flight during the read
        assert log.overlapped("a", first)              # ended after the read began
        with log.reading() as second:
            assert not log.overlapped("a", second)     # ended before this read began
            assert not log.overlapped("b", first)      # never removed
            with log.removing(["a"]):                  # removed again: in flight for both
                assert log.overlapped("a", second) and log.overlapped("a", first)
        assert log.overlapped("a", first)              # the first read may still ask
    assert log._names == {} and len(log._ended) == 0   # no read left to ask: nothing kept


def test_names_kept_for_one_long_read_cost_the_other_reads_nothing_each():
    def per_read_s(kept: int) -> float:
        log = RemovalLog()
        with log.reading():                             # one long read keeps every name removed
            names = [f"n{i}" for i in range(kept)]
            for j in range(0, kept, 8192):
                with log.removing(names[j:j + 8192]):
                    pass
            assert len(log._names) == kept
            best = float("inf")
            for _ in range(3):                          # best of three: the machine is shared
                t0 = time.perf_counter()
                for _ in range(2000):
                    with log.reading():
                        pass
                best = min(best, (time.perf_counter() - t0) / 2000)
            return best

    few, many = per_read_s(100), per_read_s(100_000)
    # a rescan of every kept name made the 1,000x larger log ~1,000x slower per read
    assert many < 10 * few, (few, many)
