"""``kvtier simulate --planner`` sizes the tier-on and tier-off fleets by one rule: a hit the
replay served from HBM costs no load in either, and only hits from the tiers below are charged,
the seconds the replay spent loading them (s32 a7 D2: the tier-on fleet was sized with every
hit loaded over the pod link, HBM hits included, while the tier-off fleet had them free)."""

from __future__ import annotations

import math

import pytest

from kvtier.planner.hardware import cost_models
from kvtier.planner.live import FleetSizer
from kvtier.planner.models import load_model
from kvtier.planner.workers import SLATargets
from kvtier.sim import fleet
from kvtier.sim.cluster import load_cluster
from kvtier.sim.policies import make_policy
from kvtier.sim.trace import Trace, TraceRequest

TARGETS = SLATargets(2.0, 0.05, 0.9)
BLOCK_TOKENS = 512


def _turns(count: int) -> Trace:
    """``count`` turns 1 s apart, each 1,000 prompt tokens: block 1 shared, then a block of its own.
    Every turn after the first reuses block 1 from wherever the cluster kept it."""
    return Trace(tuple(TraceRequest(float(i), 1000, 10, (1, 2 + i)) for i in range(count)), BLOCK_TOKENS)


def test_hbm_hits_alone_size_the_tier_on_and_tier_off_fleets_alike():
    # Three turns 1 s apart land on a worker that still holds block 1 in HBM: the tier serves
    # nothing, so tier on and tier off replay the same service and must get the same fleet.
    out = fleet.simulate_planned_day(_turns(3), load_cluster(None), TARGETS)
    on, off = out["with_tier"], out["without_tier"]
    assert on["hit_rate"] == off["hit_rate"] > 0
    assert on["mean_prefill_service_s"] == off["mean_prefill_service_s"]
    assert on["static"]["prefill_workers"] == off["static"]["prefill_workers"]
    assert on["planned"]["peak_prefill_workers"] == off["planned"]["peak_prefill_workers"]
    assert out["prefill_worker_hours_with_tier"] == out["prefill_worker_hours_without_tier"]


def _pass_and_sizer(cluster):
    model = load_model(cluster.model)
    costs = cost_models(model, cluster.accelerator, cluster.devices_per_worker, cluster.calibration)
    svc = fleet.service_pass(_turns(6), cluster, model, costs.prefill, costs.decode, make_policy("tier_aware"))
    return svc, fleet.fleet_sizer(cluster, model, costs, TARGETS, svc), model


def _mean_load_s(sizer, svc) -> float:
    """Mean seconds a prefill spends loading in ``sizer``'s queue model, for the replay's mix:
    its mean service less that of the same model with every hit free."""
    free = FleetSizer(sizer.targets, sizer.prefill, sizer.decode, math.inf, sizer.decode_kv_tokens)
    mix = (1.0, tuple(svc.input_tokens.tolist()), tuple(svc.output_tokens.tolist()), svc.hit_rate, 1.0)
    return sizer.size(*mix).mean_prefill_s - free.size(*mix).mean_prefill_s


def test_hits_from_below_hbm_are_charged_the_seconds_the_replay_spent_loading_them():
    # No HBM to keep block 1: every hit is read from a tier below, at that tier's rate.
    cluster = load_cluster(None).replace(hbm_cache_bytes=0)
    svc, sizer, model = _pass_and_sizer(cluster)
    assert svc.hit_rate > 0 and svc.load_s.sum() > 0
    assert sizer.load_bytes_per_s < max(t.read_bytes_per_s for t in cluster.tiers)   # charged, never free
    assert _mean_load_s(sizer, svc) == pytest.approx(float(svc.load_s.mean()), rel=1e-9)


def test_hbm_hits_cost_the_sizer_no_load():
    svc, sizer, _ = _pass_and_sizer(load_cluster(None))
    assert svc.hit_rate > 0 and svc.load_s.sum() == 0   # the turns' hits were all in HBM
    assert sizer.load_bytes_per_s == math.inf
    assert _mean_load_s(sizer, svc) == 0
