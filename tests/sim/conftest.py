"""Fixtures for the simulator tests: a Mooncake trace with the figures it must give, and tiny traces.

``conversation_trace`` is the published trace when it is at hand
(``../shared/data/traces/`` or ``$KVTIER_TRACE``), else the 500-request slice of it that
ships in ``tests/data``: no simulator test skips on a clean clone. Each comes with its own
reference figures (see tests/data/README.md), so the same assertions hold on either.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from kvtier.sim.trace import Trace, TraceRequest, default_trace_path, load_trace

SHIPPED_SLICE = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_head500.jsonl"


@dataclass(frozen=True)
class ReferenceTrace:
    """A Mooncake trace and what an unbounded prefix-hit replay of it must find."""

    trace: Trace
    origin: str  #: "published" (the whole trace) or "shipped" (the slice in tests/data)
    requests: int
    duration_s: tuple[float, float]  #: bounds
    block_hits: tuple[int, int] | float  #: (hit, total) blocks, or the published rate
    token_hits: tuple[int, int] | float

    @staticmethod
    def rate(figure) -> float:
        return figure[0] / figure[1] if isinstance(figure, tuple) else figure


def shipped() -> ReferenceTrace:
    return ReferenceTrace(load_trace(SHIPPED_SLICE), "shipped", 500, (164.9, 165.1),
                          (2283, 14162), (1_167_589, 7_124_855))


@pytest.fixture(scope="session")
def shipped_trace() -> ReferenceTrace:
    return shipped()


@pytest.fixture(scope="session")
def conversation_trace(shipped_trace) -> ReferenceTrace:
    path = default_trace_path()
    if path is None or not path.is_file():
        return shipped_trace
    # The published figures (tests/data/README.md; the paper reports about 40 %).
    return ReferenceTrace(load_trace(path), "published", 12_031, (55 * 60, 60 * 60), 0.366, 0.374)


def _make_trace(rows, block_tokens: int = 4) -> Trace:
    """``rows``: (arrival_s, blocks[, output_tokens]); prompts fill their blocks exactly."""
    requests = []
    for row in rows:
        arrival, blocks = row[0], tuple(row[1])
        output = row[2] if len(row) > 2 else 8
        requests.append(TraceRequest(arrival, len(blocks) * block_tokens, output, blocks))
    return Trace(tuple(requests), block_tokens)


@pytest.fixture
def make_trace():
    return _make_trace
