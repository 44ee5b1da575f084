"""Trace files kvtier has not seen, and traces whose clock does not start at 0.

Each file must load, or be refused with a ConfigError naming it (exit 2 from the CLI), never
a traceback. A trace's figures must not depend on where its clock starts: a window cut from a
longer trace, or one exported with absolute or negative times, is the same workload. Each case
failed before its fix (audit s25, D1-D5)."""

from __future__ import annotations

import gzip
import json

import pytest

from kvtier.errors import ConfigError
from kvtier.planner.hardware import cost_models
from kvtier.planner.models import load_model
from kvtier.sim import run_simulation
from kvtier.sim.cluster import ClusterConfig, load_cluster
from kvtier.sim.metrics import summarize
from kvtier.sim.policies import make_policy
from kvtier.sim.simulator import ClusterSimulator
from kvtier.sim.trace import Trace, TraceRequest, load_trace

from tests.sim.conftest import SHIPPED_SLICE

MODEL = load_model("llama-3-70b")
GOOD = {"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [1, 2]}


def _write(tmp_path, rows, name="t.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


# -- D1: numbers json reads that fit no float or count ------------------------------------------
@pytest.mark.parametrize("line", [
    '{"timestamp": 0, "input_length": 1e999, "output_length": 10, "hash_ids": [1, 2]}',
    '{"timestamp": 0, "input_length": 1000, "output_length": 1e999, "hash_ids": [1, 2]}',
    '{"timestamp": 0, "input_length": 1000, "output_length": Infinity, "hash_ids": [1, 2]}',
    '{"timestamp": %d, "input_length": 1000, "output_length": 10, "hash_ids": [1, 2]}' % (10 ** 400),
    '{"timestamp": 0, "input_length": 1000.9, "output_length": 10, "hash_ids": [1, 2]}',
    '{"timestamp": 0, "input_length": 1000, "output_length": true, "hash_ids": [1, 2]}',
], ids=["input_1e999", "output_1e999", "output_Infinity", "timestamp_1e400", "input_fraction", "output_bool"])
def test_numbers_that_are_no_count_or_time_are_a_config_error(tmp_path, line):
    path = _write(tmp_path, [GOOD, line])
    assert len(load_trace(_write(tmp_path, [GOOD], "good.jsonl")).requests) == 1   # the control loads
    with pytest.raises(ConfigError, match="line 2: not a Mooncake request"):
        load_trace(path)


def test_a_whole_float_count_still_loads(tmp_path):
    trace = load_trace(_write(tmp_path, [{**GOOD, "input_length": 1000.0}]))
    assert trace.requests[0].input_tokens == 1000 and isinstance(trace.requests[0].input_tokens, int)


# -- D2, D3: gzip, bytes that are not UTF-8, a byte-order mark -----------------------------------
def test_a_gzipped_trace_loads_as_the_plain_one(tmp_path):
    plain = load_trace(SHIPPED_SLICE)
    packed = tmp_path / "slice.jsonl.gz"
    packed.write_bytes(gzip.compress(SHIPPED_SLICE.read_bytes()))
    assert load_trace(packed).requests == plain.requests


def test_a_trace_with_a_utf8_bom_loads(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(GOOD) + "\n", encoding="utf-8-sig")
    assert load_trace(path).requests[0].blocks == (1, 2)


@pytest.mark.parametrize("content", [
    json.dumps(GOOD).encode()[:-1] + b', "user": "caf\xe9"}\n',      # Latin-1 in a field
    b"\x1f\x8b\x08\x00garbage\xff\xfe\n",                              # a corrupt gzip stream
    gzip.compress(json.dumps(GOOD).encode() + b"\n")[:-12],            # a truncated one
    gzip.compress(b"\xff\xfe not text\n"),                             # gzipped bytes, not UTF-8
], ids=["latin1", "corrupt_gzip", "truncated_gzip", "gzipped_binary"])
def test_bytes_that_are_not_a_utf8_jsonl_are_a_config_error(tmp_path, content):
    path = tmp_path / "t.jsonl"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match="not a UTF-8 JSONL"):
        load_trace(path)


# -- D4, D5: where the trace's clock starts ------------------------------------------------------
def test_arrivals_are_read_from_the_first_request(tmp_path):
    rows = [{**GOOD, "timestamp": t} for t in (-3_600_000, -3_599_000, -3_597_500)]
    trace = load_trace(_write(tmp_path, rows))
    assert [r.arrival_s for r in trace.requests] == [0.0, 1.0, 2.5]
    assert trace.duration_s == 2.5


def _one(trace: Trace):
    cluster = ClusterConfig(prefill_workers=1, decode_workers=1, block_tokens=trace.block_tokens)
    costs = cost_models(MODEL, cluster.accelerator, cluster.devices_per_worker)
    return ClusterSimulator(cluster, MODEL, costs.prefill, costs.decode, make_policy("round_robin")).run(trace)


@pytest.mark.parametrize("arrival_s", [-5.0, 100.0])
def test_a_lone_request_takes_its_prefill_time_and_its_rate_is_over_the_run(arrival_s):
    """Hand-computed: one request on an idle worker has TTFT = its prefill time, and its
    prefill rate is its tokens over the run (arrival to last finish), wherever it arrives.
    A trace built in code is not rebased, so the simulator itself must not assume clock 0."""
    at_0 = _one(Trace((TraceRequest(0.0, 1000, 10, (1, 2)),), 512))
    moved = _one(Trace((TraceRequest(arrival_s, 1000, 10, (1, 2)),), 512))
    assert at_0.outcomes[0].ttft_s == pytest.approx(at_0.outcomes[0].plan.seconds)   # the control
    assert moved.outcomes[0].ttft_s == pytest.approx(at_0.outcomes[0].ttft_s)
    assert moved.end_s - arrival_s == pytest.approx(at_0.end_s)
    report, ref = summarize(moved), summarize(at_0)
    assert report.prefill_tokens_per_s_per_worker[0] == pytest.approx(1000 / at_0.end_s, rel=0.01)
    assert report.prefill_tokens_per_s_per_worker == ref.prefill_tokens_per_s_per_worker
    assert report.decode_tokens_per_s_per_worker == ref.decode_tokens_per_s_per_worker
    assert report.itl_p50_s == pytest.approx(ref.itl_p50_s)


def test_a_shifted_trace_file_gives_the_same_figures(tmp_path):
    rows = [json.loads(x) for x in SHIPPED_SLICE.read_text().splitlines()[:60]]
    shifted = _write(tmp_path, [{**r, "timestamp": r["timestamp"] - 3_600_000} for r in rows])
    cluster = load_cluster(None)
    a = run_simulation(load_trace(SHIPPED_SLICE).head(60), cluster, ["tier_aware"]).reports["tier_aware"]
    b = run_simulation(load_trace(shifted), cluster, ["tier_aware"]).reports["tier_aware"]
    assert a.hit_rate > 0 and b.hit_rate == pytest.approx(a.hit_rate)
    assert b.ttft_p50_s == pytest.approx(a.ttft_p50_s, rel=1e-6)


def test_throughput_does_not_depend_on_where_the_clock_starts(shipped_trace):
    trace = shipped_trace.trace.head(100)
    late = Trace(tuple(TraceRequest(r.arrival_s + 3600.0, r.input_tokens, r.output_tokens, r.blocks)
                       for r in trace.requests), trace.block_tokens)
    cluster = load_cluster(None)
    a = run_simulation(trace, cluster, ["round_robin"]).reports["round_robin"]
    b = run_simulation(late, cluster, ["round_robin"]).reports["round_robin"]
    assert b.ttft_p50_s == pytest.approx(a.ttft_p50_s, rel=1e-6)
    assert sum(a.prefill_tokens_per_s_per_worker) > 0
    assert sum(b.prefill_tokens_per_s_per_worker) == pytest.approx(sum(a.prefill_tokens_per_s_per_worker), rel=0.01)
    assert sum(b.decode_tokens_per_s_per_worker) == pytest.approx(sum(a.decode_tokens_per_s_per_worker), rel=0.01)


# -- audit s27/audit_sim2 D5: a hash id twice in one request --------------------------------------
def test_a_request_repeating_a_hash_id_is_refused(tmp_path):
    """A hash id names the prefix up to its block, so one id cannot come twice in a request.
    Such a trace (per-block content hashes, not chained: a prompt of repeated boilerplate) was
    accepted, and a cache holding ONE block then served the whole 3-block prompt."""
    rows = [{"timestamp": t, "input_length": 1536, "output_length": 8, "hash_ids": [7, 7, 7]} for t in (0, 1000)]
    path = _write(tmp_path, rows)
    with pytest.raises(ConfigError, match=r"line 1: .*hash id 7 repeats within the request"):
        load_trace(path, 512)


def test_an_id_repeated_across_requests_is_a_shared_prefix(tmp_path):
    """The control: the same ids in two requests are a shared prefix, as the format means."""
    rows = [{"timestamp": t, "input_length": 1536, "output_length": 8, "hash_ids": [7, 8, 9]} for t in (0, 1000)]
    trace = load_trace(_write(tmp_path, rows), 512)
    assert [r.blocks for r in trace.requests] == [(7, 8, 9), (7, 8, 9)]
