"""``bench remote`` and ``bench storage`` post figures of what they say they measured: the quota
stress at its quota's block count, valid JSON past the last histogram bucket, the sealed path
judged against plain kvtier, redis-benchmark on redis-py's value size, the disk limit on the
tier's kind of memory, ``--drop-caches`` applied, and no flag accepted that the mode ignores
(audit s30 a13: D1-D4, D8, D11, D12)."""

from __future__ import annotations

import builtins
import io
import json
import math
import os
import re
import shutil
import time

import numpy as np
import pytest

from kvtier.bench import remote as bench_remote
from kvtier.bench import storage as bench_storage
from kvtier.cli.main import build_parser
from kvtier.errors import ConfigError
from kvtier.tiers.remote import RemoteTier


def _strict_json(text: str) -> dict:
    """``json.loads`` that refuses NaN and Infinity, as a strict reader (jq, JSON.parse) does."""
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def _bench(argv: list[str], capsys) -> dict:
    args = build_parser().parse_args(["bench", *argv, "--json"])
    assert args.func(args) == 0
    return _strict_json(capsys.readouterr().out)


# -- D12: the quota stress runs at the quota it posts ---------------------------------------------
def test_quota_stress_holds_the_tenant_at_exactly_its_quota_of_blocks():
    result = bench_remote.quota_stress(blocks=1000, measure_puts=20)
    # before: the quota was 1000 x 64 B while the server charges a 64 B block a page: 15 blocks held
    assert result["blocks_indexed"] == result["quota_blocks"] == 1000
    assert result["quota_bytes"] == 1000 * result["footprint_per_block"]
    assert result["above_last_bucket"] == [] and result["warnings"] == []


def test_quota_stress_stops_when_the_tenant_holds_fewer_blocks_than_posted(monkeypatch):
    # the bench's old rule (a 64 B block charged 64 B) against the real server's charge: a quota too small
    monkeypatch.setattr(bench_remote, "_stress_footprint", lambda: bench_remote._STRESS_BLOCK)
    with pytest.raises(RuntimeError, match=r"after the fill the tenant holds \d+ blocks, not the 1000"):
        bench_remote.quota_stress(blocks=1000, measure_puts=5)


# -- D11: a PUT above the histogram's last bucket is still valid JSON ------------------------------
def test_quota_stress_json_above_the_last_bucket_is_the_last_edge_flagged(monkeypatch, capsys):
    # The server's histogram, simulated: one of the five measured PUTs took longer than 2.5 s.
    edges = [2.5e-5, 1e-4, 1e-3, 2.5, math.inf]
    scrapes = iter([dict.fromkeys(edges, 0.0), {2.5e-5: 0.0, 1e-4: 3.0, 1e-3: 4.0, 2.5: 4.0, math.inf: 5.0}])
    monkeypatch.setattr(bench_remote, "_put_histogram", lambda addr, token: next(scrapes))
    result = _bench(["remote", "--quota-stress", "--blocks", "200", "--measure-puts", "5"], capsys)
    assert result["put_p50_ms"] == pytest.approx(0.1)
    assert result["put_p99_ms"] == result["put_max_bucket_ms"] == pytest.approx(2500.0)
    assert result["above_last_bucket"] == ["put_p99_ms", "put_max_bucket_ms"]
    assert any("last finite bucket" in w and "lower bound" in w for w in result["warnings"])


# -- D8: the sealed path faster than plain kvtier is warned about ----------------------------------
def test_a_sealed_transfer_faster_than_plain_kvtier_is_warned_about(monkeypatch):
    get_many = RemoteTier.get_many

    def plain_gets_slow(self, keys, outs):  # a plain baseline that waits for nothing the sealed path waits for
        if self.namespace in ("bench", "bench-lanes"):
            time.sleep(0.2)
        return get_many(self, keys, outs)

    monkeypatch.setattr(RemoteTier, "get_many", plain_gets_slow)
    result = bench_remote.run(1.0, 4, 1, False, with_redis=False, encrypt=True)
    assert result["encrypt_get_ratio"] > 1.05
    assert any(w.startswith("encrypt_get_ratio = ") and "plain kvtier" in w for w in result["warnings"])


# -- D4: redis-benchmark moves the values redis-py moves, and says which ---------------------------
@pytest.mark.parametrize("block_mib, value, tail", [(0.25, 256 << 10, None), (1.5, 1 << 20, 512 << 10)])
def test_redis_benchmark_runs_on_redis_pys_value_size(block_mib, value, tail):
    if shutil.which("redis-server") is None or shutil.which("redis-benchmark") is None:
        pytest.skip("redis-server / redis-benchmark not installed (make sysdeps)")
    result = bench_remote.run(block_mib, 2, 1, False, with_redis=True)
    assert "redis_error" not in result, result.get("redis_error")
    # c_client_gbps checks the stored value's length against the size it was asked for
    assert result["redis_value_bytes"] == value and result["redis_benchmark_get_gbps"] > 0
    assert result.get("redis_tail_value_bytes") == tail


# -- D3: bench remote refuses the flags a mode would run without -----------------------------------
@pytest.mark.parametrize("argv, named", [
    (["--target", "mooncake", "--no-server", "--block-mib", "4", "--encrypt"], "--block-mib and --encrypt"),
    (["--target", "mooncake", "--run-mib", "8"], "--run-mib"),
    (["--target", "mooncake", "--no-server", "--unix", "--no-redis"], "--no-redis and --unix"),
    (["--target", "mooncake", "--quota-stress"], "--quota-stress"),
    (["--quota-stress", "--block-mib", "4", "--encrypt", "--runs", "3"], "--block-mib, --encrypt and --runs"),
    (["--quota-stress", "--no-redis"], "--no-redis"),
    (["--blocks", "10", "--measure-puts", "5"], "--blocks and --measure-puts"),
    (["--no-server"], "--no-server"),
])
def test_bench_remote_refuses_flags_its_mode_ignores(argv, named):
    args = build_parser().parse_args(["bench", "remote", *argv])
    with pytest.raises(ConfigError, match=f"^{re.escape(named)} (is|are) not read here"):
        args.func(args)


@pytest.mark.parametrize("flags, transport", [([], "tcp"), (["--unix"], "unix")])
def test_quota_stress_runs_over_the_transport_asked_for(flags, transport, capsys):
    result = _bench(["remote", "--quota-stress", "--blocks", "50", "--measure-puts", "5", *flags], capsys)
    assert result["transport"] == transport and result["blocks_indexed"] == 50


# -- D1: the encrypted disk bench's raw limit does its I/O on the tier's kind of memory ------------
def _thp_eligible(addr: int) -> bool:
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("THPeligible:"):
                return line.split()[1] == "1"
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.parametrize("block_mib", [1.0, 4.0])
def test_the_encrypted_disk_limit_moves_its_bytes_from_the_same_memory_kind_as_the_tier(block_mib, tmp_path,
                                                                                       monkeypatch):
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        if "[never]" in f.read():
            pytest.skip("transparent huge pages are off on this machine")
    requests: list[tuple[int, int]] = []  # (buffer address, bytes) of each write or read
    preadv, pwrite = os.preadv, os.pwrite

    def address(buf) -> int:
        return np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8).__array_interface__["data"][0]

    def recorded_preadv(fd, bufs, offset, *rest):
        requests.extend((address(b), memoryview(b).nbytes) for b in bufs)
        return preadv(fd, bufs, offset, *rest)

    def recorded_pwrite(fd, data, offset):
        requests.append((address(data), memoryview(data).nbytes))
        return pwrite(fd, data, offset)

    nbytes = int(block_mib * (1 << 20))
    bench = bench_storage._EncryptedDiskBench(nbytes, 2, str(tmp_path), False)
    keys = bench_storage._keys(0, 2)
    kinds: dict[tuple[str, str], set[bool]] = {}

    def each_side(phase: str, ops) -> None:
        for i, key in enumerate(keys):
            for side, op in zip(bench.SIDES, ops):
                requests.clear()
                op(i, key)
                kinds.setdefault((phase, side), set()).update(
                    _thp_eligible(addr) for addr, n in requests if n >= nbytes // 2)

    bench.start(keys)
    try:
        monkeypatch.setattr(os, "preadv", recorded_preadv)
        monkeypatch.setattr(os, "pwrite", recorded_pwrite)
        each_side("put", bench.put_ops())
        monkeypatch.undo()
        bench.between(keys)
        monkeypatch.setattr(os, "preadv", recorded_preadv)
        monkeypatch.setattr(os, "pwrite", recorded_pwrite)
        each_side("get", bench.get_ops())
        monkeypatch.undo()
        for i in range(len(keys)):
            bench.verify_get(i, bench.SIDES.index("limit"))  # the limit's reads still land, and are checked
    finally:
        monkeypatch.undo()
        bench.cleanup(keys)
        bench.close()
    for phase in ("put", "get"):
        assert kinds[(phase, "sealed")] == {True}, kinds  # the tier's staging: huge pages
        assert kinds[(phase, "limit")] == kinds[(phase, "sealed")], kinds  # before: 4 KiB pages


# -- D2: --drop-caches is applied with --encrypt, and refused where there are no files -------------
@pytest.fixture
def drop_cache_writes(monkeypatch):
    """Writes to /proc/sys/vm/drop_caches, caught (this machine's page cache is left alone)."""
    writes: list[str] = []
    real_open = builtins.open

    def catching_open(path, *args, **kwargs):
        if path == "/proc/sys/vm/drop_caches":
            writes.append(path)
            return io.StringIO()
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", catching_open)
    monkeypatch.setattr(bench_storage.os, "sync", lambda: None)
    return writes


@pytest.mark.parametrize("encrypt", [False, True])
def test_drop_caches_is_applied_before_every_round_of_gets(encrypt, tmp_path, drop_cache_writes):
    bench_storage.run("disk", 1.0, 2, 1, str(tmp_path), drop_caches=True, encrypt=encrypt)
    assert len(drop_cache_writes) == 2  # the warm-up round and the measured one


@pytest.mark.parametrize("flags, named", [(["--drop-caches"], "--drop-caches is"),
                                          (["--dir", "."], "--dir is"),
                                          (["--dir", ".", "--drop-caches"], "--dir and --drop-caches are")])
def test_bench_storage_host_refuses_the_disk_flags(flags, named, drop_cache_writes):
    args = build_parser().parse_args(["bench", "storage", "--tier", "host", "--block-mib", "0.25", "--blocks", "2",
                                      "--runs", "1", *flags])
    with pytest.raises(ConfigError, match=f"^{named} for --tier disk"):
        args.func(args)
    assert drop_cache_writes == []
