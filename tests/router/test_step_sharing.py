"""Shared prefill steps: vLLM prefills its waiting queue in steps of at most
``max_num_batched_tokens`` and answers every request of a step when the step ends, so a
request queued behind others delays those it shares its step with. Tier-aware prices that
delay (the increase of the summed TTFT), so that a burst's requests are not packed where
they hold up a step full of others."""

from __future__ import annotations

import pytest

from kvtier.router.workers import Worker

from tests.router.test_policies import BS, SYSTEM, router, store

SPEED = 2000.0


def _queue(worker: Worker, *tokens: int) -> None:
    for n in tokens:
        worker.start(n, 1)


def test_a_newcomer_delays_only_the_requests_of_the_last_partial_step():
    w = Worker(0, "http://w0")
    assert w.step_sharing_delay_s(300, 2048, SPEED) == 0.0           # idle: nobody to delay
    _queue(w, 500)
    assert w.step_sharing_delay_s(300, 2048, SPEED) == 0.0           # the head is running: not delayed
    _queue(w, *[100] * 6)
    # six waiting requests in one partial step (600 of 2048): each waits 300 tokens longer
    assert w.step_sharing_delay_s(300, 2048, SPEED) == pytest.approx(6 * 300 / SPEED)
    # only the room left in that step delays them (1448 tokens), the rest go to a later step
    assert w.step_sharing_delay_s(5000, 2048, SPEED) == pytest.approx(6 * 1448 / SPEED)
    # waiting requests that fill whole steps: the newcomer starts a step of its own
    full = Worker(1, "http://w1")
    _queue(full, 500, 1024, 1024)
    assert full.step_sharing_delay_s(300, 2048, SPEED) == 0.0
    # a request that spans steps: only those whose last token is in the partial step count
    spans = Worker(2, "http://w2")
    _queue(spans, 500, 2000, 100, 100)       # steps: [2000 + 48 of the first 100], [52 + 100]
    assert spans.step_sharing_delay_s(300, 2048, SPEED) == pytest.approx(2 * 300 / SPEED)
    # no shared steps (step_tokens 0): no delay
    assert w.step_sharing_delay_s(300, 0, SPEED) == 0.0
    # first bytes take requests out, by ticket
    ticket = w.start(700, 1)
    w.first_byte(700, 0.5, others=3, ticket=ticket)
    assert list(w.queued.values()) == [500] + [100] * 6


def _two_queues(r):
    """Worker 0: a running request and six small ones waiting; worker 1: a running request and
    one large one waiting. Every block of the new request is in the shared tier."""
    for worker, waiting in ((0, [100] * 6), (1, [900])):
        _queue(r.workers[worker], 500, *waiting)
    prompt = SYSTEM[: 8 * BS]
    store(r, 0, prompt, shared=True)
    return prompt + [9] * 300


def test_tier_aware_keeps_a_request_out_of_a_step_full_of_others():
    r = router()
    prompt = _two_queues(r)
    worker, _, _ = r.decide(prompt, set())
    # its own TTFT: 1100 + 300 tokens on worker 0 against 1400 + 300 on worker 1 (0.15 s
    # better), but on worker 0 six requests wait 0.15 s each for it (0.9 s), on worker 1 one
    assert worker.id == 1
    # positive control: workers that share no steps (--step-tokens 0): its own TTFT decides
    r0 = router(step_tokens=0)
    prompt = _two_queues(r0)
    worker, _, _ = r0.decide(prompt, set())
    assert worker.id == 0


def test_step_tokens_must_not_be_negative():
    from kvtier.errors import ConfigError

    with pytest.raises(ConfigError, match="step_tokens"):
        router(step_tokens=-1)
