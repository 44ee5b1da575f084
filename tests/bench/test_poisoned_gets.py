"""Benchmarks read into poisoned buffers and check them: a get that writes nothing is an error, not a figure."""

import numpy as np
import pytest

from kvtier.bench import remote as bench_remote
from kvtier.bench import storage as bench_storage
from kvtier.tiers.base import Status
from kvtier.tiers.host import HostTier
from kvtier.tiers.remote import RemoteTier


def _writes_nothing(self, key, out):
    return Status.OK


def _writes_other_bytes(self, key, out):
    np.asarray(out).view(np.uint8)[:] = 7
    return Status.OK


def test_bench_storage_runs_and_checks_every_get():
    result = bench_storage.run("host", 0.25, 4, 1)
    assert result["get_ratio"] > 0 and result["put_ratio"] > 0


@pytest.mark.parametrize("broken, message", [(_writes_nothing, "never written"),
                                             (_writes_other_bytes, "other bytes")])
def test_bench_storage_stops_on_a_get_that_does_not_deliver(monkeypatch, broken, message):
    monkeypatch.setattr(HostTier, "get", broken)
    with pytest.raises(RuntimeError, match=f"tier get of block 0 reported success but the buffer .*{message}"):
        bench_storage.run("host", 0.25, 4, 1)


def test_bench_remote_stops_on_a_get_that_does_not_deliver(monkeypatch):
    monkeypatch.setattr(RemoteTier, "get_many", lambda self, keys, outs: [Status.OK] * len(keys))
    with pytest.raises(RuntimeError, match="kvtier get of block 0 .* never written"):
        bench_remote.run(0.25, 1, 1, False, with_redis=False)


def test_bench_remote_reports_redis_py_and_redis_benchmark_on_the_same_values():
    import shutil

    if shutil.which("redis-server") is None or shutil.which("redis-benchmark") is None:
        pytest.skip("redis-server / redis-benchmark not installed (make sysdeps)")
    result = bench_remote.run(1, 4, 1, False, with_redis=True)
    assert "redis_error" not in result, result.get("redis_error")
    assert result["redis_py_get_gbps"] > 0 and result["redis_benchmark_get_gbps"] > 0
    assert result["redis_benchmark_set_gbps"] > 0 and result["redis_value_bytes"] == 1 << 20
    assert isinstance(result["warnings"], list)


def test_bench_remote_encrypted_is_judged_against_the_best_plain_lane_count():
    result = bench_remote.run(1, 4, 2, False, with_redis=False, encrypt=True)
    best_put = max(result["put_gbps"], result["plain_lanes_put_gbps"])
    # per-run medians, so not exact; but never above the one-lane ratio by construction
    assert result["encrypt_put_ratio"] <= result["encrypt_put_ratio_vs_one_lane"] + 1e-9
    assert result["encrypt_get_ratio"] <= result["encrypt_get_ratio_vs_one_lane"] + 1e-9
    assert 0 < result["encrypted_put_gbps"] <= 2 * best_put
