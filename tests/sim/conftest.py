"""Fixtures for the simulator tests: the published trace (skipped when absent) and tiny traces."""

from __future__ import annotations

import pytest

from kvtier.sim.trace import TRACE_HINT, Trace, TraceRequest, default_trace_path, load_trace


@pytest.fixture(scope="session")
def conversation_trace() -> Trace:
    path = default_trace_path()
    if path is None:
        pytest.skip(f"conversation trace absent: {TRACE_HINT}")
    return load_trace(path)


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
