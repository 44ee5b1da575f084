"""``bench remote``: the quota stress posts the tenant's bytes in the quota's unit, and every mode
refuses a run count under 1 before anything starts (audit s31 a5 D1, D3)."""

from __future__ import annotations

import pytest

from kvtier.bench import mooncake as bench_mooncake
from kvtier.bench import remote as bench_remote
from kvtier.cli.main import main
from kvtier.errors import ConfigError
from kvtier.tiers.mooncake_launch import MooncakeCluster


# -- D1: the tenant's bytes beside the quota are what the quota is charged ------------------------
def test_quota_stress_posts_the_tenants_charge_in_the_quotas_unit():
    """``tenant_bytes`` was the admin usage figure, payload bytes (64 B a block), beside
    ``quota_bytes`` in footprints (a page a block): a tenant exactly at its quota read as 1.6 % full."""
    result = bench_remote.quota_stress(blocks=200, measure_puts=5)
    assert result["blocks_indexed"] == result["quota_blocks"] == 200
    assert result["tenant_charged_bytes"] == result["quota_bytes"] == 200 * result["footprint_per_block"]
    assert result["tenant_payload_bytes"] == 200 * bench_remote._STRESS_BLOCK   # the payload, named as such
    assert "tenant_bytes" not in result


# -- D3: --runs below 1 is refused in every mode, before a Mooncake cluster starts ----------------
@pytest.fixture
def cluster_starts(monkeypatch):
    """A tripwire on ``MooncakeCluster.start``: the list of starts asked for, each refused (a
    master and a 768 MiB holder started for a bench of no run, then a KeyError on the medians)."""
    started = []

    def tripwire(cls, *a, **kw):
        started.append(kw)
        raise AssertionError("a Mooncake cluster was started for a bench of no run")

    monkeypatch.setattr(MooncakeCluster, "start", classmethod(tripwire))
    return started


@pytest.mark.parametrize("runs", ["0", "-3"])
@pytest.mark.parametrize("mode", [["--target", "mooncake", "--no-redis"], ["--target", "mooncake", "--no-server"],
                                  ["--no-redis"]], ids=["mooncake", "mooncake-alone", "server"])
def test_runs_below_one_is_refused_in_every_mode(cluster_starts, capsys, mode, runs):
    rc = main(["bench", "remote", *mode, "--runs", runs, "--json"])
    err = capsys.readouterr().err
    # the server mode refused it already (its own check, in the bench); the Mooncake modes started a cluster
    assert rc == 2 and cluster_starts == [] and "--runs" in err, err


def test_the_mooncake_bench_refuses_no_run_before_its_cluster_starts(cluster_starts):
    with pytest.raises(ConfigError, match="runs must be at least 1, got 0"):
        bench_mooncake.run(runs=0)
    assert cluster_starts == []
