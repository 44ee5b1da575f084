"""Cluster configs are validated on load; decode batches share their steps."""

from __future__ import annotations

import json

import pytest

from kvtier.errors import ConfigError
from kvtier.planner.costmodel import DecodeCostModel
from kvtier.planner.models import load_model
from kvtier.sim.cluster import ClusterConfig, TierSpec, load_cluster
from kvtier.sim.decode import DecodeJob, simulate_decode


def test_the_shipped_default_cluster_loads():
    cluster = load_cluster()
    assert cluster.tier_names[0] == "hbm" and len(cluster.tier_names) == len(cluster.tiers) + 1
    assert {t.scope for t in cluster.tiers} == {"worker", "pod"}


def test_unknown_fields_are_rejected_with_the_known_ones(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"prefill_worker": 3}))
    with pytest.raises(ConfigError, match="prefill_workers"):
        load_cluster(path)
    with pytest.raises(ConfigError, match="not found"):
        load_cluster(tmp_path / "absent.json")


@pytest.mark.parametrize("bad", [dict(scope="rack"), dict(read_bytes_per_s=0), dict(capacity_bytes=-1)])
def test_bad_tiers_are_rejected(bad):
    with pytest.raises(ConfigError):
        TierSpec(**{"name": "t", "scope": "worker", "capacity_bytes": 1e9, "read_bytes_per_s": 1e9, **bad})


def test_hbm_is_implicit_and_workers_are_positive():
    with pytest.raises(ConfigError, match="hbm"):
        ClusterConfig(tiers=(TierSpec("hbm", "worker", None, 1e12),))
    with pytest.raises(ConfigError, match="prefill_workers"):
        ClusterConfig(prefill_workers=0)


def _decode():
    return DecodeCostModel(load_model("llama-3-8b"), hbm_bytes_per_s=3e12, flops_per_s=1e15)


def test_a_lone_request_decodes_at_the_single_sequence_step():
    model = _decode()
    result = simulate_decode([DecodeJob(0.0, 1000, 100)], 1, model, capacity_tokens=10_000)
    assert result.itl_s == [pytest.approx(model.step_seconds(1, 1000 + 50))]
    assert result.tokens_per_worker == [100]


def test_a_full_kv_pool_makes_the_next_request_wait_its_turn():
    model = _decode()
    jobs = [DecodeJob(0.0, 1000, 100), DecodeJob(0.0, 1000, 100)]
    alone = simulate_decode(jobs[:1], 1, model, capacity_tokens=1500).busy_until_s
    serial = simulate_decode(jobs, 1, model, capacity_tokens=1500)    # room for one at a time
    batched = simulate_decode(jobs, 1, model, capacity_tokens=3000)   # both fit: one shared batch
    assert serial.busy_until_s == pytest.approx(2 * alone)
    assert alone < batched.busy_until_s < serial.busy_until_s
    assert sum(batched.tokens_per_worker) == 200


def test_requests_spread_over_decode_workers():
    result = simulate_decode([DecodeJob(0.0, 1000, 50)] * 4, 2, _decode(), capacity_tokens=100_000)
    assert result.tokens_per_worker == [100, 100]
