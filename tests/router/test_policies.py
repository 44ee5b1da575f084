"""The shared policies over the router's live view: tier pricing, no pile-up, approximate fallback."""

from __future__ import annotations

from kvtier.policy.routing import Approximate, PrefixOverlap, TierAware
from kvtier.router.app import Router
from kvtier.router.config import RouterConfig, WorkerSpec
from kvtier.router.index import block_keys

BS = 32
SYSTEM = list(range(1000, 1000 + 64 * BS))       # a 2048-token system prompt


def router(n=2, policy="tier-aware", **kw) -> Router:
    config = RouterConfig(workers=[WorkerSpec(f"http://w{i}") for i in range(n)], policy=policy, block_tokens=BS,
                          kv_bytes_per_token=4096, prefill_tokens_per_s=2000.0, **kw)
    r = Router(config, tokenizer=None)
    for w in r.workers:
        w.events_up = True
    return r


def store(r: Router, worker: int, tokens, medium="GPU", shared=False) -> None:
    n = len(tokens) // BS
    r.index.stored(worker, [(worker, i) for i in range(n)], None, tokens[:n * BS], BS, medium, shared=shared)


def route(r: Router, tokens) -> int:
    worker, predicted, keys = r.decide(tokens, set())
    worker.start(len(tokens) - predicted, len(keys))   # in flight: its load counts from now on
    return worker.id


def test_tier_aware_prefers_the_worker_that_can_load_the_prefix():
    r = router()
    store(r, 1, SYSTEM, medium="CPU")             # worker 1 has it in host DRAM only
    assert route(r, SYSTEM + [1] * 100) == 1
    # ... unless loading is slower than recomputing (a very slow host link): then it is
    # worth nothing and the idle worker wins
    slow = router(host_read_bytes_per_s=1e3)
    store(slow, 0, SYSTEM, medium="CPU")
    slow.workers[0].pending_tokens = 100
    assert route(slow, SYSTEM + [1] * 100) == 1


def test_shared_tier_is_loadable_by_every_worker_and_priced_by_its_bandwidth():
    r = router()
    store(r, 0, SYSTEM, shared=True)
    r.index.clear_worker(0)                       # worker 0 lost its GPU copy; the shared tier has it
    keys = block_keys(SYSTEM, BS)
    worker, predicted, _ = r.decide(SYSTEM, set())
    assert predicted == len(SYSTEM) - 1           # loadable on whichever worker is picked
    from kvtier.router.view import LiveView

    view = LiveView(r.service, r.workers, r.index, keys, 2000.0, 0.0)
    assert view.prefix_tiers(0, keys) == view.prefix_tiers(1, keys) == [2] * 64


def test_a_prefix_every_worker_can_load_does_not_pin_traffic():
    """Dynamo #737: a system prompt on every request must not send everything to one worker."""
    for shared in (True, False):
        r = router(n=4)
        if shared:
            store(r, 0, SYSTEM, shared=True)      # in worker 0's GPU and in the shared tier
        else:
            for w in range(4):
                store(r, w, SYSTEM)               # in every worker's GPU
        picks = [route(r, SYSTEM + [7, i] * 64) for i in range(40)]
        counts = [picks.count(w) for w in range(4)]
        assert min(counts) >= 8, (shared, counts)


def test_a_prefix_only_one_worker_holds_still_attracts_its_requests():
    r = router(n=4)
    store(r, 2, SYSTEM)
    assert route(r, SYSTEM + [5] * 64) == 2


def test_prefix_policy_sees_gpu_blocks_only():
    r = router(policy="prefix")
    assert isinstance(r.policy, PrefixOverlap)
    store(r, 1, SYSTEM, medium="CPU")
    assert route(r, SYSTEM + [1] * 32) == 0       # host DRAM earns Dynamo's score nothing
    store(r, 1, SYSTEM, medium="GPU")
    assert route(r, SYSTEM + [2] * 32) == 1


def test_events_down_falls_back_to_the_routers_own_decisions():
    r = router()
    assert isinstance(r.policy, TierAware) and not r.approximate_mode
    first = route(r, SYSTEM + [3] * 32)           # recorded in the approximate tree too
    r.workers[0].events_up = r.workers[1].events_up = False
    assert r.approximate_mode
    assert route(r, SYSTEM + [4] * 32) == first   # same prefix, same worker, without any index entry
    assert len(r.index) == 0


def test_approximate_policy_balances_when_loads_diverge():
    r = router(policy="approximate")
    assert isinstance(r.policy, Approximate)
    first = route(r, SYSTEM)
    r.workers[first].pending_tokens = 10**6       # far more than the balance allowance
    assert route(r, SYSTEM) != first


def test_softmax_temperature_spreads_near_ties():
    r = router(temperature=1.0)
    picks = {route(r, SYSTEM[:BS * 2]) for _ in range(20)}
    assert picks == {0, 1}
