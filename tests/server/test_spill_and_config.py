"""Disk spill behind the DRAM pool; configuration errors that name the fix; the CLI entry points."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from kvtier.errors import ConfigError
from kvtier.server.config import load_config, parse_size
from kvtier.server.launch import ServerProcess, write_config
from kvtier.tiers.base import Status
from kvtier.server.events import EventSubscriber
from tests.server.conftest import block, keys_for, remote
from tests.server.events_keys import EventsKeys
from tests.server.harness import SHARED, tenants

SLOT = 128 * 1024
EVENTS = EventsKeys({"router": "*"})


def test_blocks_evicted_from_dram_spill_to_disk_and_come_back(tmp_path):
    with ServerProcess.start(tenants(), shared=SHARED, workdir=str(tmp_path), server={
        "capacity": 4 * SLOT, "max_block": SLOT, "disk_dir": str(tmp_path / "disk"), "disk_capacity": "16MiB",
        **EVENTS.server_config(),
    }, env=EVENTS.server_env()) as srv:
        sub = EventSubscriber(srv.info["events"], **EVENTS.creds("router"))
        time.sleep(0.3)
        tier = remote(srv, "acme", namespace="spill")
        keys = keys_for("spill", 12)
        assert tier.put_many(keys, [block(k, SLOT) for k in keys]) == [Status.OK] * 12
        assert tier.lookup_prefix(keys) == 12  # 4 in DRAM, 8 demoted to disk
        outs = [np.zeros(SLOT, np.uint8) for _ in keys]
        assert tier.get_many(keys, outs) == [Status.OK] * 12
        assert all(np.array_equal(o, block(k, SLOT)) for o, k in zip(outs, keys))
        tiers_seen = set()
        while (got := sub.recv(timeout_s=0.3)) is not None:
            tiers_seen.update((e["type"], e["tier"]) for e in got[1])
        assert {("stored", "host"), ("removed", "host"), ("stored", "disk")} <= tiers_seen
        sub.close()


def test_config_errors_name_the_fix(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[server]\ncapcity = "1GiB"\n')
    with pytest.raises(ConfigError, match="did you mean 'capacity'"):
        load_config(path, env={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml", env={})
    with pytest.raises(ConfigError, match="hash-token"):
        load_config(None, env={"KVTIER_SERVE_TENANTS": "acme=plaintext-token"})
    with pytest.raises(ConfigError, match="holds no block"):
        load_config(None, env={}, overrides={"capacity": "1MiB", "max_block": "8MiB"})
    with pytest.raises(ConfigError, match="tls_cert"):
        load_config(None, env={}, overrides={"listen": "tls://127.0.0.1:7443"})
    with pytest.raises(ConfigError, match="512MiB"):
        parse_size("lots", "capacity")
    write_config(str(path), {"listen": ["tcp://127.0.0.1:0"]}, {"acme": {"token": "t", "read_shared": ["nope"]}})
    with pytest.raises(ConfigError, match="no \\[\\[shared\\]\\] defines"):
        load_config(path, env={})


def test_file_then_environment_then_flags(tmp_path):
    path = tmp_path / "c.toml"
    write_config(str(path), {"capacity": "64MiB", "max_block": "1MiB", "idle_timeout_s": 10}, {"acme": {"token": "t"}})
    env = {"KVTIER_SERVE_CAPACITY": "128MiB", "KVTIER_SERVE_IDLE_TIMEOUT_S": "20"}
    c = load_config(path, env=env, overrides={"idle_timeout_s": 30})
    assert (c.capacity_bytes, c.max_block_bytes, c.idle_timeout_s) == (128 << 20, 1 << 20, 30.0)
    assert c.tenants[0].name == "acme"


def test_serve_refuses_to_start_without_tenants_and_says_how():
    out = subprocess.run([sys.executable, "-m", "kvtier.server", "--listen", "tcp://127.0.0.1:0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--tenant NAME=" in out.stderr


def test_bench_remote_runs_and_reports_the_ratios():
    from kvtier.bench.remote import run

    result = run(block_mib=1, run_mib=4, runs=1, unix=False, with_redis=True)
    for field in ("put_gbps", "get_gbps", "put_ratio_vs_socket", "get_ratio_vs_socket"):
        assert result[field] and result[field] > 0, result
    assert result["get_ratio_vs_redis_py"] or "redis_error" in result


@pytest.mark.parametrize("name", ["idle_timeout_s", "frame_timeout_s", "hello_timeout_s", "mooncake_timeout_s"])
def test_a_timeout_longer_than_a_day_is_a_config_error_naming_it(name):
    """A "never give up" timeout such as 1e10 passed the check, then a wait on it overflowed the
    platform's clock at start (OverflowError, a traceback). Control: a day exactly is taken."""
    from kvtier.server.config import load_config

    with pytest.raises(ConfigError, match=name.replace("_", "[_-]") + ".*at most 86400"):
        load_config(None, env={}, overrides={"listen": ["tcp://127.0.0.1:0"], name: 1e10})
    assert getattr(load_config(None, env={}, overrides={"listen": ["tcp://127.0.0.1:0"], name: 86400}), name) == 86400
