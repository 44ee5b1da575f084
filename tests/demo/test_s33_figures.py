"""Demo figures: the TTFT median is a true median; "per turn with a hit" figures need a hit."""

from __future__ import annotations

import io
import statistics
import types

from rich.console import Console

from kvtier.demo import worker
from kvtier.demo.report import print_summary
from kvtier.demo.summary import summarize


def _runs_of(ttfts):
    it = iter(ttfts)
    return lambda: types.SimpleNamespace(ttft_s=next(it))


def test_a_second_run_implies_a_third_so_the_median_is_no_slower_run():
    # two 0.5-0.6 s recomputes add up to a second: before, measuring stopped at two and took the slower
    runs = worker.measure(_runs_of([0.60, 0.50, 0.55]), lambda g: True)
    assert [r.ttft_s for r in runs] == [0.60, 0.50, 0.55]
    assert worker.median(runs).ttft_s == statistics.median([0.60, 0.50, 0.55])


def test_one_long_run_or_an_unrepeatable_one_stays_one():
    assert len(worker.measure(_runs_of([1.2]), lambda g: True)) == 1
    assert len(worker.measure(_runs_of([0.1]), lambda g: False)) == 1


def _miss(i):
    return dict(index=i, phase=1, kind="turn", ttft_cold_s=2.0, ttft_warm_s=2.0, context_tokens=4096,
                cached_tokens=0, computed_tokens=4096, loaded_bytes={}, tokens_by_tier={}, lookup_s=0.004,
                load_s=0.0, prefill_s=1.9, speedup=1.0, outputs_equal=True, logits_max_abs_diff=0.0,
                cpu_cold_s=2.0, cpu_warm_s=2.0, limits_gib_s={})


def test_with_no_hit_the_per_hit_figures_are_none_and_not_printed():
    s = summarize([_miss(i) for i in range(4)], [{"phase": 1}], runtime_s=10.0, scenario="x")
    assert (s["lookup_s_p50"], s["lookup_s_p90"], s["load_s_p50"], s["prefill_s_p50"]) == (None,) * 4
    out = io.StringIO()
    print_summary(Console(file=out, width=200), s)
    assert "with a hit" not in out.getvalue()
