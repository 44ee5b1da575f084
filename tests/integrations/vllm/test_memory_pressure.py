"""Real vLLM with the kvtier connector when its KV cache is far too small for the batch.

Six prompts of 400-585 tokens, each generating 200 more (~4,600 tokens in all), into a KV
cache of 34 pages (1,088 tokens), prefilled 128 tokens a step: vLLM prefills in chunks and
preempts running requests (frees their pages, puts them back in the queue to start again).
The connector then sees what the rest of the suite never shows it: saves planned chunk by
chunk, a request whose pages vanish and come back as other pages, and a preempted request's
second admission, which looks its prompt up again and loads what it saved itself before
(the positive control: in the cold round, nothing else could have put those blocks there).

The reference is plain vLLM under the same pressure (the same pages, the same chunking).
Batch composition moves a logprob by an ulp (the engines schedule differently once loads
take a step), so logprobs are compared within 1e-4; a page filled with another request's
KV, or left poisoned (the suite's ``KVTIER_DEBUG_POISON``), moves them by far more.
"""

from __future__ import annotations

import pytest

from tests.integrations.vllm.harness import loaded_tokens, prompts, skip_without_vllm

skip_without_vllm()

pytestmark = pytest.mark.timeout(500)

PRESSURE = {"kv_pages": 34, "max_model_len": 1024, "max_num_batched_tokens": 128}


def _assert_same_answers(got: list[dict], want: list[dict]) -> None:
    for i, (a, b) in enumerate(zip(got, want)):
        assert a["token_ids"] == b["token_ids"], f"request {i}: other tokens than plain vLLM"
        worst = max(abs(p - q) for x, y in zip(a["logprobs"], b["logprobs"]) for (_, p), (_, q) in zip(x, y))
        assert worst < 1e-4, f"request {i}: a logprob moved by {worst}"


def test_preempted_and_chunked_requests_resume_from_kvtier_with_plain_vllms_answers(engines, tiny_model):
    batch = prompts(6, 400, seed=21)
    plain = engines("pressure-plain", {"model": tiny_model, "extra": None, **PRESSURE})
    kv = engines("pressure-kvtier", {"model": tiny_model, **PRESSURE,
                                     "extra": {"block_tokens": 64, "host_bytes": "64MiB"}})
    plain.wait_ready()
    kv.wait_ready()
    assert kv.call(op="stats")["worker"]["poison"], "the suite runs every engine with poisoned loads"

    want = plain.generate(batch, sequential=False, max_tokens=200)
    cold = kv.generate(batch, sequential=False, max_tokens=200)
    _assert_same_answers(cold, want)
    resumed = [loaded_tokens(o) for o in cold]
    print("tokens loaded in the cold round (preempted requests resuming):", resumed)
    assert sum(resumed) > 0, "control: some request was preempted and resumed from its own saved blocks"

    kv.call(op="flush")
    assert kv.call(op="reset")["ok"] and plain.call(op="reset")["ok"]
    want = plain.generate(batch, sequential=False, max_tokens=200)
    warm = kv.generate(batch, sequential=False, max_tokens=200)
    _assert_same_answers(warm, want)
    loaded = [loaded_tokens(o) for o in warm]
    print("tokens loaded in the warm round:", loaded)
    assert sum(loaded) >= 1000, loaded
    assert kv.call(op="stats")["worker"]["failed_pages"] == 0
