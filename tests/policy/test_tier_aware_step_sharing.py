"""TierAware over any ClusterView: the step-sharing delay is added where the view offers it
(the router's live view) on both pricing paths, and the cost is unchanged where it does not
(the simulator's one-request-at-a-time workers), so ``kvtier simulate`` predicts as before."""

from __future__ import annotations

from types import SimpleNamespace

from kvtier.policy.routing import TierAware


class _Plan:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds


class _View:
    """Two workers; worker 0 is 0.1 s less busy, but the request would hold up a step of others there."""

    num_workers = 2

    def __init__(self, delays=None, fast=False) -> None:
        self.service = SimpleNamespace(plan=lambda tiers, tokens: _Plan(0.2))
        self._delays = delays
        if delays is not None:
            self.step_sharing_delay_s = lambda worker, request: delays[worker]
        if fast:
            self.service_seconds = lambda request: [0.2, 0.2]

    def backlog_s(self, worker: int) -> float:
        return (0.5, 0.6)[worker]

    def prefix_tiers(self, worker, blocks):
        return []


REQUEST = SimpleNamespace(input_tokens=300, blocks=[])


def test_the_step_sharing_delay_is_priced_on_both_paths():
    for fast in (False, True):
        view = _View(delays=[0.9, 0.15], fast=fast)
        assert TierAware().costs(REQUEST, view) == [0.5 + 0.2 + 0.9, 0.6 + 0.2 + 0.15]
        assert TierAware().choose(REQUEST, view) == 1, fast


def test_without_the_delay_the_cost_is_the_requests_own_ttft():
    for fast in (False, True):
        view = _View(fast=fast)
        assert TierAware().costs(REQUEST, view) == [0.7, 0.8]
        assert TierAware().choose(REQUEST, view) == 0, fast
