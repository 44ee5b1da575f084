"""``kvtier top --once`` against a real ``kvtier serve``: the frame's figures are the server's /metrics."""

from __future__ import annotations

import argparse
import re
import urllib.request

import numpy as np
import pytest

from kvtier.cli import top as top_cli
from kvtier.cli.admin import admin_call
from kvtier.server.launch import ServerProcess
from kvtier.tiers.base import Status
from tests.server.conftest import BLOCK, block, keys_for, remote
from tests.server.harness import SHARED, TOKENS, tenants


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess.start(tenants(), shared=SHARED, admin_token=TOKENS["admin"],
                              workdir=str(tmp_path_factory.mktemp("kvtier-top")),
                              server={"capacity": "16MiB", "max_block": "1MiB", "metrics": "127.0.0.1:0"})
    yield srv
    srv.stop()


def _metrics(srv) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    req = urllib.request.Request(f"http://{srv.info['metrics']}/metrics",
                                 headers={"Authorization": f"Bearer {TOKENS['admin']}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_once_renders_the_server_figures(server, capsys, monkeypatch):
    tier = remote(server, "globex", namespace="top")
    keys = keys_for("top", 5)
    assert tier.put_many(keys, [block(k) for k in keys]) == [Status.OK] * 5
    out = np.zeros(BLOCK, np.uint8)
    assert tier.get(keys[0], out) is Status.OK
    assert tier.get(keys_for("absent", 1)[0], out) is Status.MISS
    parser = argparse.ArgumentParser()
    top_cli.register(parser.add_subparsers())
    _admin_token_in_env(monkeypatch)
    args = parser.parse_args(["top", "--server", server.info["metrics"], "--once", "--router", "127.0.0.1:1"])
    assert args.func(args) == 0
    frame = capsys.readouterr().out
    m = _metrics(server)
    used = m[("kvtier_tier_used_bytes", (("tier", "host"),))]
    cap = m[("kvtier_tier_capacity_bytes", (("tier", "host"),))]
    assert used > 0
    host_row = next(line for line in frame.splitlines() if re.search(r"\bhost\b", line))
    assert top_cli._bytes(used) in host_row and top_cli._bytes(cap) in host_row
    assert f"{used / cap:.1%}" in host_row
    hits = m[("kvtier_hits_total", (("op", "get"),))]
    misses = m[("kvtier_misses_total", (("op", "get"),))]
    assert f"get hit rate {hits / (hits + misses):.1%}" in frame
    assert f"{m[('kvtier_stored_blocks', ())]:.0f} blocks stored" in frame
    # Per-tenant series need the admin token; the router given is not listening: shown as down.
    globex = next(line for line in frame.splitlines() if "globex" in line)
    assert f"{m[('kvtier_tenant_blocks', (('tenant', 'globex'),))]:.0f}" in globex
    assert "down: router" in frame


def _admin_token_in_env(monkeypatch) -> None:
    """``kvtier top`` takes the admin token (on this loopback metrics address) from the environment."""
    monkeypatch.delenv("KVTIER_METRICS_TOKEN", raising=False)
    monkeypatch.setenv("KVTIER_ADMIN_TOKEN", TOKENS["admin"])


def test_once_shows_a_tenants_charges_against_its_quota(server, capsys, monkeypatch):
    """Blocks of 64 B each take a 4 KiB page: a tenant at its quota of 10 pages holds 640 B of
    payload. The frame shows it charged 100 % of its quota, not payload's 1.6 % (s32 a7 D8)."""
    quota = 10 * 4096
    assert admin_call(server.tcp_url, TOKENS["admin"], "set_quota", {"tenant": "ops", "bytes": quota})["ok"]
    try:
        ops = remote(server, "ops", namespace="tiny")
        try:
            keys = keys_for("top-tiny", 12)
            assert [ops.put(k, block(k, 64)) for k in keys] == [Status.OK] * 12
            assert ops.server_stats()["charged_bytes"] == quota, "control: ops is at its quota"
        finally:
            ops.close()
        parser = argparse.ArgumentParser()
        top_cli.register(parser.add_subparsers())
        _admin_token_in_env(monkeypatch)
        args = parser.parse_args(["top", "--server", server.info["metrics"], "--once"])
        assert args.func(args) == 0
        frame = capsys.readouterr().out
    finally:
        admin_call(server.tcp_url, TOKENS["admin"], "set_quota", {"tenant": "ops", "bytes": 0})
    header = next(line for line in frame.splitlines() if "of quota" in line)
    assert "charged" in header and "quota" in header
    row = next(line for line in frame.splitlines() if re.search(r"\bops\b", line))
    assert "640 B" in row and row.count(top_cli._bytes(quota)) == 2 and "100.0%" in row, row


def test_without_any_endpoint_it_says_what_to_give(capsys):
    parser = argparse.ArgumentParser()
    top_cli.register(parser.add_subparsers())
    args = parser.parse_args(["top", "--once"])
    assert args.func(args) == 2
    assert "--server" in capsys.readouterr().err


@pytest.mark.parametrize("status", ['[1, 2]', '{"prefill": "scale_up"}', '"text"'])
def test_a_planner_status_file_of_another_shape_is_shown_empty_not_a_crash(tmp_path, capsys, status):
    parser = argparse.ArgumentParser()
    top_cli.register(parser.add_subparsers())
    path = tmp_path / "status.json"
    path.write_text(status)
    args = parser.parse_args(["top", "--once", "--router", "127.0.0.1:1", "--planner-status", str(path)])
    assert args.func(args) == 0
    assert "down: router" in capsys.readouterr().out
    # control: a planner's status file is shown
    path.write_text('{"prefill": {"action": "scale_up", "current": 2, "target": 3, "reason": "queue"}}')
    assert args.func(args) == 0
    assert "scale_up" in capsys.readouterr().out
