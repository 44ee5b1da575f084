"""The router prices loads with bandwidths measured on the deployment: the JSON that
``kvtier bench storage --tier host --json`` / ``kvtier bench remote --json`` print, through
``--measured`` or ``measured = [...]`` in the config file; a user's explicit figure wins."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from kvtier.cli.route import build_config, register
from kvtier.errors import ConfigError
from kvtier.router.app import Router
from kvtier.router.config import RouterConfig, WorkerSpec, measured_bandwidth


def _args(*argv):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["route", "--worker", "http://127.0.0.1:9", *argv])


@pytest.fixture(scope="module")
def host_json(tmp_path_factory):
    """A real, small ``kvtier bench storage --tier host --json`` run."""
    out = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "bench", "storage", "--tier", "host",
                          "--block-mib", "1", "--blocks", "8", "--runs", "1", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    path = tmp_path_factory.mktemp("bench") / "host.json"
    path.write_text(out.stdout)
    return path


def test_a_storage_bench_file_sets_the_host_bandwidth_the_router_prices_with(host_json):
    measured = json.loads(host_json.read_text().strip().splitlines()[-1])["get_gbps"] * 1e9
    config = build_config(_args("--measured", str(host_json)))
    assert config.host_read_bytes_per_s == pytest.approx(measured)
    assert config.read_bandwidths()["host"] == (pytest.approx(measured), str(host_json))
    assert config.read_bandwidths()["shared"][1] == "default"
    router = Router(config, tokenizer=None, block_bytes=1 << 20)
    # the service model loads a host block in block_bytes / measured seconds
    assert router.service.block_load_s[1] == pytest.approx((1 << 20) / measured)
    text = router.metrics.render().decode()
    assert f'kvtier_router_tier_read_bytes_per_s{{source="{host_json}",tier="host"}}' in text
    # positive control: without the file the default is priced
    assert build_config(_args()).read_bandwidths()["host"] == (8e9, "default")


def test_an_explicit_flag_wins_over_the_measurement(host_json):
    config = build_config(_args("--measured", str(host_json), "--host-bandwidth", "123e6"))
    assert config.read_bandwidths()["host"] == (123e6, "setting")


def test_remote_bench_output_sets_the_shared_bandwidth_and_config_files_find_theirs(tmp_path):
    # the keys `kvtier bench remote --json` prints (plain, then an --encrypt run)
    (tmp_path / "remote.json").write_text(json.dumps({"bench": "remote", "get_gbps": 2.5, "put_gbps": 2.0}))
    (tmp_path / "sealed.json").write_text(json.dumps({"bench": "remote", "get_gbps": 2.5,
                                                      "encrypted_get_gbps": 1.25}))
    assert measured_bandwidth(tmp_path / "remote.json") == ("shared_read_bytes_per_s", 2.5e9)
    assert measured_bandwidth(tmp_path / "sealed.json") == ("shared_read_bytes_per_s", 1.25e9)
    (tmp_path / "router.toml").write_text('measured = ["remote.json"]\n[[worker]]\nurl = "http://127.0.0.1:9"\n')
    config = RouterConfig.from_file(tmp_path / "router.toml").check()
    assert config.read_bandwidths()["shared"] == (2.5e9, str(tmp_path / "remote.json"))
    # a bandwidth written in the file is the user's own
    (tmp_path / "own.toml").write_text('measured = ["remote.json"]\nshared_read_bytes_per_s = 5e8\n'
                                       '[[worker]]\nurl = "http://127.0.0.1:9"\n')
    assert RouterConfig.from_file(tmp_path / "own.toml").check().read_bandwidths()["shared"] == (5e8, "setting")


@pytest.mark.parametrize("content, message", [
    ("not json", "not the JSON"),
    (json.dumps({"tier": "disk", "get_gbps": 3.0}), "prices no disk tier"),
    (json.dumps({"tier": "host", "get_gbps": 0}), "positive number"),
])
def test_a_wrong_file_is_a_clear_error(tmp_path, content, message):
    path = tmp_path / "x.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        RouterConfig(workers=[WorkerSpec("http://127.0.0.1:9")], measured=[str(path)]).check()
    with pytest.raises(ConfigError, match="No such file"):
        RouterConfig(workers=[WorkerSpec("http://127.0.0.1:9")], measured=[str(tmp_path / "none")]).check()
