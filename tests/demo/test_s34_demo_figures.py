"""The demo's figures judge what they claim to (audit s34 a12): a mixed host+disk load against
the longer of its overlapped parts, under a key of its own (D1); a turn's first-token logits,
not only its greedy tokens, in ``outputs_equal`` and the exit code (D2)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest

from kvtier.demo.runner import exit_code
from kvtier.demo.summary import ideal_load_s, load_efficiency, summarize
from kvtier.integrations.transformers import cache_io
from tests.demo.test_summary import record

GIB = 1 << 30
BLOCK = 256 << 10                                  # the demo's blocks
TURN_14 = {"host": 64 * BLOCK, "disk": 44 * BLOCK}  # the demo's turn 14: 1,024 host + 704 disk tokens
LIMITS = {"host": 5.0, "disk": 1.5}                 # GiB/s, as BENCHMARKS.md reports for the VM
T_HOST = TURN_14["host"] / (LIMITS["host"] * GIB)
T_DISK = TURN_14["disk"] / (LIMITS["disk"] * GIB)


def test_load_blocks_overlaps_the_tiers_which_the_ideal_assumes():
    assert "the longer of the two, not" in inspect.getdoc(cache_io.load_blocks).replace("\n", " ")


def test_a_mixed_load_is_judged_against_the_longer_of_its_parts():
    at_limits = max(T_HOST, T_DISK)                 # the disk's reads while the host runs are copied
    assert ideal_load_s(TURN_14, LIMITS) == pytest.approx(at_limits)
    assert load_efficiency(TURN_14, at_limits, LIMITS) == pytest.approx(1.0)         # old: 1.436
    assert load_efficiency(TURN_14, at_limits / 0.7, LIMITS) == pytest.approx(0.7)   # old: 1.005


def test_mixed_turns_have_their_own_key_and_no_false_warning():
    host_only = record(0, cold=5.0, warm=1.0, loaded={"host": 64 * BLOCK}, load_s=2 * T_HOST, lookup_s=0.0)
    disk_only = record(1, cold=5.0, warm=1.0, loaded={"disk": 44 * BLOCK}, load_s=T_DISK / 0.5, lookup_s=0.0)
    mixed = record(2, cold=5.0, warm=1.0, loaded=dict(TURN_14), load_s=max(T_HOST, T_DISK), lookup_s=0.0)
    s = summarize([host_only, disk_only, mixed], [{"phase": 1, "limits_gib_s": LIMITS}], runtime_s=1.0, scenario="t")
    # the mixed turn is neither the host's (most bytes) nor the disk's figure
    assert s["load_efficiency_p50"] == {"disk": pytest.approx(0.5), "host": pytest.approx(0.5),
                                        "host+disk": pytest.approx(1.0)}
    assert s["load_efficiency_turns"] == {"disk": 1, "host": 1, "host+disk": 1}
    assert s["warnings"] == []                      # old: "host load_efficiency = 1.436 > 1.05 ..."
    assert s["overhead_ratio_p90"] == pytest.approx(2.0)   # lookup + load over the overlapped ideal


# --- D2: the logits ---

def _turn(diff: float, *, tolerance: float = 1e-3, tokens_equal: bool = True) -> dict:
    """A turn record as the worker writes it: its 8 greedy tokens matched, its logits ``diff`` off."""
    turn = record(0, cold=1.0, warm=0.05, loaded={"host": 1 << 20}, equal=tokens_equal)
    turn.update(logits_max_abs_diff=diff, logits_tolerance=tolerance)
    return turn


@pytest.mark.parametrize("diff", [0.7, float("nan")], ids=["off", "nan"])
def test_logits_off_the_recompute_fail_the_run_although_the_tokens_match(diff, capsys):
    s = summarize([_turn(diff)], [{"phase": 1}], runtime_s=1.0, scenario="t")
    assert s["outputs_equal"] is False               # old: True
    assert exit_code(s) == 1                         # old: 0
    reason = "logits were NaN" if diff != diff else "more than their tolerance on turns #1"
    assert reason in capsys.readouterr().err


def test_logits_within_the_tolerance_pass():
    s = summarize([_turn(2.5e-6)], [{"phase": 1}], runtime_s=1.0, scenario="t")
    assert s["outputs_equal"] is True and s["logits_off_turns"] == []
    assert exit_code(s) == 0


def test_the_worker_compares_every_runs_logits_against_a_relative_tolerance():
    torch = pytest.importorskip("torch")
    from kvtier.demo.worker import logits_diff, logits_tolerance

    reference = torch.tensor([4.0, -8.0, 1.0])
    run = lambda *logits: SimpleNamespace(first_logits=torch.tensor(logits))  # noqa: E731
    assert logits_tolerance(reference, torch.float32) == pytest.approx(8e-3)  # 1e-3 x max |logit|
    # the median warm run matched; another warm run did not: the turn's figure is the worst
    assert logits_diff(reference, [run(4.0, -8.0, 1.0), run(4.0, -8.0, 1.5)]) == pytest.approx(0.5)
    diff = logits_diff(reference, [run(4.0, -8.0, 1.5), run(float("nan"), -8.0, 1.0)])
    assert diff != diff                              # a NaN run is never lost to the order
