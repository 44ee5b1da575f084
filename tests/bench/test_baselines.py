"""Baselines of the same kind as what they judge, and a warning on any ratio that beats its limit."""

import argparse
import mmap
import time

import numpy as np
import pytest

from kvtier.bench import storage as bench_storage
from kvtier.bench.baselines import huge_page_buffer, ratio_warnings


def test_ratios_above_the_bound_are_warned_about_and_others_are_not():
    warnings = ratio_warnings({"put_ratio": 1.114, "get_ratio": 1.05, "x": 0.7, "missing": None})
    assert len(warnings) == 1
    assert warnings[0].startswith("put_ratio = 1.114 > 1.05") and "baseline is wrong" in warnings[0]
    assert ratio_warnings({"a": 1.0501}, above=1.1) == []


def _mapping_of(buf: np.ndarray) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding ``buf``."""
    addr = buf.__array_interface__["data"][0]
    fields: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside:
                name, _, value = line.partition(":")
                fields[name] = value.strip()
    return fields


def test_the_host_baseline_buffer_is_huge_page_memory_faulted_in_like_the_pool():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read()
    except OSError:
        pytest.skip("no transparent huge pages here")
    if "[never]" in thp:
        pytest.skip("transparent huge pages are off on this machine")
    buf = huge_page_buffer(16 << 20)
    smaps = _mapping_of(buf)
    assert smaps.get("THPeligible") == "1", smaps  # advised before the first touch (a plain mmap is 0 under "madvise")
    assert int(smaps["Rss"].split()[0]) * 1024 >= buf.nbytes - mmap.PAGESIZE  # prefaulted: no fault in the timing


def test_a_baseline_slower_than_the_tier_is_reported_as_wrong(monkeypatch, capsys):
    limit_get = bench_storage._HostBench.limit_get

    def slow_limit_get(self, i):  # a baseline that misses what the tier has (say, huge pages)
        limit_get(self, i)
        time.sleep(0.01)

    monkeypatch.setattr(bench_storage._HostBench, "limit_get", slow_limit_get)
    args = argparse.Namespace(tier="host", block_mib=0.25, blocks=4, runs=1, dir=None, drop_caches=False,
                              encrypt=False, json=True)
    assert bench_storage._main(args) == 0
    out, err = capsys.readouterr()
    assert '"warnings": ["get_ratio = ' in out
    assert "WARNING: get_ratio = " in err and "baseline is wrong" in err


def test_the_server_figures_beside_mooncake_carry_their_wrong_baseline_warnings(monkeypatch):
    """The kvtier server's ratios run beside the Mooncake figures are judged like any other: a
    warning of the server run (its ratio against the raw socket above the bound) reaches the
    result's own warnings, not only its GB/s (it was dropped, leaving a 1.2 ratio unflagged)."""
    from kvtier.bench import remote as bench_remote

    def server_run(block_mib, run_mib, runs, unix, with_redis):
        ratio = 1.2 if block_mib == 32 else 0.9
        return {"get_gbps": 3.7, "socket_get_gbps": 3.7 / ratio, "get_ratio_vs_socket": ratio,
                "warnings": ratio_warnings({"get_ratio_vs_socket": ratio}, what="raw socket")}

    monkeypatch.setattr(bench_remote, "run", server_run)
    beside = bench_remote._beside_mooncake(1, False, False)
    assert beside["32mib"]["get_ratio_vs_socket"] == 1.2 and beside["8mib"]["get_ratio_vs_socket"] == 0.9
    assert len(beside["warnings"]) == 1  # the positive control (8 MiB, 0.9) is not warned about
    assert beside["warnings"][0].startswith("beside, 32 MiB: get_ratio_vs_socket = 1.200 > 1.05")
