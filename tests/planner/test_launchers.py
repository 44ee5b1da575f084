"""Launchers: a decision brought about by the dry-run launcher, printed with its reason."""

from __future__ import annotations

import io
import json

from kvtier.planner.launchers import DryRunLauncher, apply
from kvtier.planner.live import Decision, PoolDecision


def _decision(prefill, decode):
    return Decision(30.0, 9.0, 9.9, 0.4, 1.2,
                    PoolDecision("prefill", *prefill, "scale_up" if prefill[2] > prefill[0] else "scale_down",
                                 "because"),
                    PoolDecision("decode", *decode, "hold", "steady"))


def test_dry_run_starts_the_missing_and_drains_the_surplus():
    out = io.StringIO()
    launcher = DryRunLauncher(out)
    launcher.seed("prefill", 2)
    launcher.seed("decode", 1)
    apply(_decision((2, 4, 4), (1, 1, 1)), launcher)
    assert len(launcher.list("prefill")) == 4 and len(launcher.list("decode")) == 1
    assert out.getvalue().count("would start prefill") == 2
    # Down to 1: the two still starting go first (no requests, no cache), then one serving worker.
    apply(_decision((4, 1, 1), (1, 1, 1)), launcher)
    live = [w for w in launcher.list("prefill") if w.state in ("starting", "serving")]
    assert len(live) == 1 and live[0].state == "serving"
    assert out.getvalue().count("would drain") == 3


def test_report_prints_reasons_or_json_lines():
    out = io.StringIO()
    DryRunLauncher(out).report(_decision((1, 3, 3), (1, 1, 1)))
    assert "prefill: scale_up 1 -> 3 (because)" in out.getvalue()
    out = io.StringIO()
    DryRunLauncher(out, json_lines=True).report(_decision((1, 3, 3), (1, 1, 1)))
    assert json.loads(out.getvalue())["prefill"]["target"] == 3
