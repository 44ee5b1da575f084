"""Trace files kvtier has not seen, and traces whose clock does not start at 0.

Each file must load, or be refused with a ConfigError naming it (exit 2 from the CLI), never
a traceback. A trace's figures must not depend on where its clock starts: a window cut from a
longer trace, or one exported with absolute or negative times, is the same workload. Each case
failed before its fix (audit s25, D1-D5)."""

from __future__ import annotations

import gzip
import json
import random

import pytest

from kvtier.cli.main import main
from kvtier.errors import ConfigError
from kvtier.planner.hardware import cost_models
from kvtier.planner.models import load_model
from kvtier.sim import run_simulation
from kvtier.sim.cache import replay_prefix_hits
from kvtier.sim.cluster import ClusterConfig, load_cluster
from kvtier.sim.metrics import summarize
from kvtier.sim.policies import make_policy
from kvtier.sim.simulator import ClusterSimulator
from kvtier.sim.trace import Trace, TraceRequest, load_trace, parse_trace_lines

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


# -- audit s27/audit_sim2 D5, s28 D2: a hash id twice in one request ------------------------------
def test_a_request_repeating_a_hash_id_is_read_as_a_prefix(tmp_path):
    """Per-block content hashes (a prompt of repeated boilerplate: [7, 7, 7]) were accepted, and a
    cache holding ONE block then served the whole 3-block prompt. s27 refused them; s28 re-keys
    them as prefixes (7, then 7 after 7, then 7 after that): three blocks, which the same prompt
    again hits in full and nothing else does."""
    rows = [{"timestamp": t, "input_length": 1536, "output_length": 8, "hash_ids": [7, 7, 7]} for t in (0, 1000)]
    trace = load_trace(_write(tmp_path, rows), 512)
    first, again = (r.blocks for r in trace.requests)
    assert first == again and len(set(first)) == 3 and first[0] == 7
    assert replay_prefix_hits(trace).hit_blocks == 3   # the second prompt only


def test_an_id_repeated_across_requests_is_a_shared_prefix(tmp_path):
    """The control: the same ids in two requests are a shared prefix, as the format means."""
    rows = [{"timestamp": t, "input_length": 1536, "output_length": 8, "hash_ids": [7, 8, 9]} for t in (0, 1000)]
    trace = load_trace(_write(tmp_path, rows), 512)
    assert [r.blocks for r in trace.requests] == [(7, 8, 9), (7, 8, 9)]


# -- audit s28 (traces kvtier was not built on) -----------------------------------------------------
def test_s28_d1_a_deeply_nested_line_is_a_config_error_not_a_traceback(tmp_path, capsys):
    """json raises RecursionError on [[[[...]]]] 100,000 deep; the loader caught only
    ValueError/KeyError/TypeError/OverflowError, so every trace command printed a traceback."""
    path = _write(tmp_path, [GOOD, "[" * 100_000 + "]" * 100_000])
    with pytest.raises(ConfigError, match="line 2: not a Mooncake request"):
        load_trace(path)
    assert main(["simulate", "--trace", path, "--policies", "round_robin"]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_s28_a_line_that_is_not_an_object_is_named_so(tmp_path):
    with pytest.raises(ConfigError, match="line 2: not a Mooncake request .*not a JSON object but a list"):
        load_trace(_write(tmp_path, [GOOD, [1, 2]]))


@pytest.mark.parametrize("stamp", [True, None, "12"])
def test_s28_a_timestamp_that_is_no_number_is_named_so(tmp_path, stamp):
    """true loaded as 1 ms; null read "unsupported operand type(s) for /"."""
    with pytest.raises(ConfigError, match=rf"line 2: .*timestamp {stamp!r} is not a number of milliseconds"):
        load_trace(_write(tmp_path, [GOOD, dict(GOOD, timestamp=stamp)]))


CONTENT_HASHED = [{"timestamp": 1000 * i, "input_length": 1024, "output_length": 8, "hash_ids": ids}
                  for i, ids in enumerate(([1, 2], [3, 2], [2, 3], [3, 2]))]


def test_s28_d2_ids_of_block_contents_are_re_keyed_as_prefixes(tmp_path, capsys):
    """An id under two parents ([1, 2] then [3, 2]: ids hashing each block's content alone) loaded
    silently, and every hit count took [2, 3] as hitting both blocks: 0.50 of blocks where prefix
    semantics give 0.25 (only the last request's [3, 2] repeats a prefix)."""
    trace = load_trace(_write(tmp_path, CONTENT_HASHED), 512)
    assert replay_prefix_hits(trace).block_hit_rate == pytest.approx(2 / 8)
    blocks = [r.blocks for r in trace.requests]
    assert blocks[0] == (1, 2) and blocks[1] == blocks[3] and blocks[1][0] == 3
    assert len({b for req in blocks for b in req}) == 6   # six prefixes: [1] [1,2] [3] [3,2] [2] [2,3]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "re-keyed 3 (parent, id) pairs" in err[0] and "2 of them" in err[0]
    # and the simulator's figures follow: no policy hits more than the prefix bound
    report = run_simulation(trace, ClusterConfig(prefill_workers=1, decode_workers=1, block_tokens=512),
                            ["round_robin"]).reports["round_robin"]
    assert report.hit_rate <= 2 / 8 + 1e-9


@pytest.mark.parametrize("capacity", [None, 7])
def test_s28_d2_re_keyed_ids_count_exactly_the_prefix_hits(tmp_path, capacity):
    """Random prompts over 4 block contents: the replay of the re-keyed trace equals one whose
    block identity is the whole prefix (the tuple of contents up to it), unbounded and under LRU."""
    import random
    from collections import OrderedDict

    rng = random.Random(5)
    prompts = [[rng.randrange(4) for _ in range(rng.randrange(1, 6))] for _ in range(80)]
    rows = [{"timestamp": i, "input_length": 512 * len(p), "output_length": 1, "hash_ids": p}
            for i, p in enumerate(prompts)]
    got = replay_prefix_hits(load_trace(_write(tmp_path, rows), 512), capacity).hit_blocks
    cache: OrderedDict = OrderedDict()
    want = 0
    for p in prompts:
        paths = [tuple(p[:k + 1]) for k in range(len(p))]
        want += next((k for k, path in enumerate(paths) if path not in cache), len(paths))
        for path in reversed(paths):     # the tail the least recent: evicted first, as vLLM does
            cache[path] = None
            cache.move_to_end(path)
        while capacity is not None and len(cache) > capacity:
            cache.popitem(last=False)
    assert got == want > 0


def test_s28_d2_a_trace_of_chained_ids_is_read_unchanged_and_quietly(capsys):
    """The control: the shipped slice (chained ids, as every published trace) keeps every id."""
    raw = [tuple(json.loads(line)["hash_ids"]) for line in SHIPPED_SLICE.read_text().splitlines()]
    trace = load_trace(SHIPPED_SLICE)
    assert sorted(r.blocks for r in trace.requests) == sorted(raw)
    assert trace.notes == () and capsys.readouterr().err == ""


@pytest.mark.parametrize("length", [0, -5])
def test_s28_d3_a_prompt_of_no_tokens_is_named_as_such(tmp_path, length):
    """input_length 0 with no ids read '0 hash ids for 0 tokens; with 512-token blocks expect 0':
    the count matched what it expected, and the fault was never named."""
    with pytest.raises(ConfigError, match=rf"line 2: .*input_length {length}: a prompt has at least one token"):
        load_trace(_write(tmp_path, [GOOD, dict(GOOD, input_length=length, hash_ids=[])]))


def _timed(stamps):
    return [dict(GOOD, timestamp=t) for t in stamps]


@pytest.mark.parametrize("stamps, why", [
    ([0.0, 0.0, 1.52, 3.7, 4.25], "none of them a whole number"),           # seconds from 0
    ([1717000000.25, 1717000001.5, 1717000003.75], "none of them a whole number"),  # epoch seconds
    (list(range(200)), "200 requests within 199 ms"),                       # whole seconds, many requests
])
def test_s28_timestamps_that_look_like_seconds_are_flagged_on_one_line(tmp_path, capsys, stamps, why):
    trace = load_trace(_write(tmp_path, _timed(stamps)))
    assert len(trace.requests) == len(stamps)   # still read, as milliseconds
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "look like seconds" in err[0] and why in err[0], err


@pytest.mark.parametrize("stamps", [[0, 1000, 2500], [0, 0, 0], [0.0, 1000.0, 27000.0], list(range(0, 200_000, 1000)),
                                    [5] * 200])   # the last: an offline batch, every request at one instant
def test_s28_timestamps_in_milliseconds_are_not_flagged(tmp_path, capsys, stamps):
    load_trace(_write(tmp_path, _timed(stamps)))
    assert capsys.readouterr().err == ""


def _lines(stamps):
    return [json.dumps({"timestamp": t, "input_length": 600, "output_length": 10, "hash_ids": [2 * i, 2 * i + 1]})
            for i, t in enumerate(stamps)]


def test_s28_r2_float_millisecond_timestamps_over_an_hour_are_not_taken_for_seconds():
    # 200 requests over one hour in milliseconds, with sub-millisecond parts (exported from
    # datetimes / time.time() * 1000): 18 s apart, a plausible conversation service
    stamps = [round(i * 18_090.137 + 0.25, 3) for i in range(200)]
    trace = parse_trace_lines(_lines(stamps), 512, "float_ms.jsonl")
    assert 3590 < trace.duration_s < 3610
    seconds_notes = [n for n in trace.notes if "seconds" in n]
    # (regression audit s28 R2: the note said to multiply them by 1000, making the hour 41 days)
    assert seconds_notes == []


def test_s28_r2_control_a_real_seconds_trace_is_still_noted():
    """What the note is for: fractional seconds read as milliseconds squeeze 6 min into 0.36 s.
    (Requests 1.8 s apart: at 18 s apart, s28's control, the file is the same as a 55-a-second
    float-millisecond export, which s29 D1 leaves unflagged.)"""
    stamps = [round(i * 1.8090137 + 0.25, 6) for i in range(200)]
    trace = parse_trace_lines(_lines(stamps), 512, "seconds.jsonl")
    assert any("seconds" in n for n in trace.notes)


def _arrivals_s(requests: int, mean_gap_s: float) -> list[float]:
    """A service's arrival times in seconds (Poisson)."""
    rng, t, out = random.Random(7), 0.0, []
    for _ in range(requests):
        t += rng.expovariate(1 / mean_gap_s)
        out.append(t)
    return out


def test_s29_d1_seconds_with_a_few_whole_stamps_are_still_noted():
    """About one stamp in 1,000 of such an export is whole (x.000): one of them turned the note
    off, and an hour of 3,000 requests loaded as 3.5 s, 1.2 ms apart, without a word."""
    stamps = [round(t, 3) for t in _arrivals_s(3000, 1.2)]   # the usual round(time.time() - t0, 3)
    whole = sum(float(s).is_integer() for s in stamps)
    assert 0 < whole < 10   # the case: a handful whole, by chance
    trace = parse_trace_lines(_lines(stamps), 512, "seconds.jsonl")
    assert len(trace.requests) == 3000 and trace.duration_s < 4   # still read as milliseconds
    assert [n for n in trace.notes if "look like seconds" in n] == [
        f"seconds.jsonl: the timestamps look like seconds ({3000 - whole:,} of 3,000 fractional; as milliseconds, "
        f"3,000 requests over {trace.duration_s:g} s); the format's are milliseconds, and they are read so: "
        "if they are seconds, multiply them by 1000"]


@pytest.mark.parametrize("per_s", [20, 100])
def test_s29_d1_float_milliseconds_of_a_busy_service_are_not_taken_for_seconds(per_s):
    """The reverse: a float-millisecond export (datetimes, time.time() * 1000) of a service at
    more than 10 requests a second was told to multiply its stamps by 1000."""
    stamps = [round(1000 * t, 6) for t in _arrivals_s(3000, 1 / per_s)]   # time.time() * 1000
    assert not any(float(s).is_integer() for s in stamps)   # all fractional, as float seconds are
    trace = parse_trace_lines(_lines(stamps), 512, "float_ms.jsonl")
    assert 3000 / per_s * 0.9 < trace.duration_s < 3000 / per_s * 1.1
    assert [n for n in trace.notes if "seconds" in n] == []


def test_s29_d1_whole_seconds_over_an_hour_are_noted_and_whole_milliseconds_of_a_busy_service_are_not():
    """Whole seconds were noted only for 100 requests within 1,000 s; an hour of them loaded as
    3.6 s. The gap decides, as for fractional stamps; whole milliseconds at 100 a second pass."""
    arrivals = _arrivals_s(1000, 3.6)
    trace = parse_trace_lines(_lines([round(t) for t in arrivals]), 512, "seconds.jsonl")
    assert [n for n in trace.notes if "look like seconds" in n] == [
        f"seconds.jsonl: the timestamps look like seconds (1,000 requests within {trace.duration_s * 1000:g} ms); "
        "the format's are milliseconds, and they are read so: if they are seconds, multiply them by 1000"]
    trace = parse_trace_lines(_lines([round(t * 1000) for t in _arrivals_s(3000, 0.01)]), 512, "ms.jsonl")
    assert trace.notes == ()


def test_s29_d1_the_shipped_traces_load_with_no_note(conversation_trace, shipped_trace):
    """Whole milliseconds, ~0.3 s apart: the published trace (or its slice) is read as it is."""
    assert conversation_trace.trace.notes == () and shipped_trace.trace.notes == ()
