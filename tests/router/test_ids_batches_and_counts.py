"""The router's answer head, a completion batch's price and what it counts as load (audit s30
a11 D2-D6): a body ``request_id`` echoed only as a short header-safe token, a batch priced from a
text long enough to measure, that pricing off the event loop, an empty ``X-Request-Id`` taken as
vLLM takes it, and the endpoints that run no inference kept out of the planner's request rate.
Real sockets, the real ``Router`` app, stand-in workers as in test_http.py; no vLLM."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from aiohttp import ClientResponseError, ClientSession

from kvtier.cli.top import scrape
from kvtier.planner.observe import RouterCounters, observation_between
from kvtier.router.requests import AddedSpecial
from tests.router.test_http import WordTokenizer, distinct, leave_early, run, start_router, until
from tests.router.test_openai_conformance import NamingDeaf, post, recorders_router

TEXT = " ".join(["abc"] * 100)   # 399 characters, 100 tokens of the stand-in tokenizer


# --- D2: the id echoed in the answer's head -----------------------------------------------------
@pytest.mark.parametrize("own, echoed", [("r" * 20000, False), ("t" * 257, False), ("job 42", False),
                                         ("réq-1", False), ("t" * 256, True), ("job-42/step:7", True)],
                         ids=["20000", "257", "space", "non-ascii", "256", "token"])
def test_a_body_request_id_is_echoed_only_as_a_short_header_safe_token(own, echoed):
    """vLLM takes any string as a body's ``request_id`` and never puts it in a header. Echoed as
    ``X-Request-Id`` whenever printable, one of 20,000 characters made an answer head the
    client's HTTP parser refused (aiohttp: 8,190 bytes a field), though the worker had run the
    request. Controls: ids of printable ASCII without a space, up to 256 characters, are echoed."""
    async def main():
        async with recorders_router(["a"]) as ([w], router, url, s):
            try:
                async with s.post(url + "/v1/completions", json={"prompt": "a b", "request_id": own}) as r:
                    answer = await r.json()
                    header = r.headers.get("X-Request-Id")
            except ClientResponseError as exc:
                pytest.fail(f"the client could not read its answer: {exc.message[:60]}")
            assert len(w.got("/v1/completions")) == 1
            assert r.status == 200 and answer["choices"]
            assert (header == own, header is None) == (echoed, not echoed), (header or "")[:40]
    run(main())


# --- D3: the rate a batch of texts is priced at -------------------------------------------------
class BosWords(WordTokenizer):
    """The stand-in tokenizer with a BOS before each text, as a Llama tokenizer adds one."""

    added_special = AddedSpecial(1, 0)

    def completion(self, prompt, add_special_tokens=True, truncate_to=None):
        return ([1] if add_special_tokens else []) + super().completion(prompt, add_special_tokens, truncate_to)


@contextlib.asynccontextmanager
async def router_with(tokenizer):
    """A recording worker behind a real router using ``tokenizer``; yields (worker, router, url, session)."""
    async with recorders_router(["a"]) as ([w], router, url, s):
        router.tokenizer = router._pooled_tokenizer = tokenizer
        yield w, router, url, s


@pytest.mark.parametrize("tokenizer, prompt, tokens", [
    (WordTokenizer(), ["", TEXT, TEXT, TEXT, TEXT], 400),      # an empty first text measured 0 tokens a character
    (WordTokenizer(), ["hi", TEXT, TEXT, TEXT, TEXT], 401),    # a short one 0.5: priced at 801
    (BosWords(), ["", TEXT, TEXT, TEXT, TEXT], 1 + 4 * 101),   # each text's BOS too
    (WordTokenizer(), ["", "a b", "c d"], 2),                  # none long enough: 4 characters a token
    (WordTokenizer(), [TEXT, "", TEXT], 200)])                 # control: the first text measures it
def test_a_batch_is_priced_at_the_rate_of_a_text_long_enough_to_measure_it(tokenizer, prompt, tokens):
    """A batch's other texts are priced at a tokens-per-character rate; taken from its first text
    whatever that held, ``["", t, t, t, t]`` (four 100-token texts) put 0 tokens on its worker,
    in the queue's price, the admission cap and the planner's prompt mix, and a short first text
    doubled them. The rate now comes from the first text of at least 64 characters, or 1/4 when
    the batch has none; each text's special tokens count beside it."""
    async def main():
        async with router_with(tokenizer) as (w, router, url, s):
            w.release.clear()
            task = asyncio.ensure_future(post(s, url, {"prompt": prompt}))
            await until(lambda: w.got("/v1/completions"))
            pending = router.workers[0].pending_tokens
            w.release.set()
            assert (await task)[0] == 200
            return pending, router.metrics.routed_prompt_tokens.labels(w.url)._value.get()
    priced = run(main())
    assert priced == (tokens, tokens), f"priced {priced}, the batch holds {tokens} tokens"


# --- D4: a huge batch priced off the event loop -------------------------------------------------
def test_pricing_a_16mib_batch_leaves_the_event_loop_free():
    """A 16 MiB body (``max_body_bytes``) holds ~5.6 M empty texts; measuring them on the loop
    stood it still 0.2-0.4 s, and every stream the router relays with it. (Measured on the
    router's own pricing step: the body's JSON parse holds the GIL for its own ~0.3 s, from its
    thread too, which is not this.) The loop's longest pause is taken while the router prices
    such a batch whose first text is short (so the batch is also looked through for a rate):
    before, the pricing was one pause as long as itself. (Bounded as a share of the pricing's
    time: other processes on the machine's cores stretch both; quiet, it is a few ms in 0.2 s.)"""
    prompts = ["a"] + [""] * ((16 << 20) // 3)

    async def main():
        async with recorders_router(["a"]) as (_, router, url, s):
            pauses: list[float] = []
            done = False

            async def heartbeat():
                last = time.perf_counter()
                while not done:
                    await asyncio.sleep(0.001)
                    now = time.perf_counter()
                    pauses.append(now - last)
                    last = now
            beat = asyncio.ensure_future(heartbeat())
            await asyncio.sleep(0.05)
            began = time.perf_counter()
            routed = await router._completion_prompt({"prompt": prompts})
            took = time.perf_counter() - began
            done = True
            await beat
            assert routed.tokens == 1   # "a", then texts of no character
            return max(pauses), took
    longest, took = run(main())
    assert longest < took / 2, f"the event loop stood still {longest:.3f} s of the {took:.3f} s pricing took"


# --- D5: an empty X-Request-Id header ------------------------------------------------------------
def test_an_empty_x_request_id_header_names_the_request_as_vllm_does():
    """vLLM names a request by its ``X-Request-Id`` header whenever one comes, an empty one too
    (``_base_request_id``: ``is not None``), before its body's ``request_id``. The router took
    an empty header for none and named the request by its body's id: the worker ran
    ``cmpl--0`` and the router's abort named ``cmpl-r1-0``, which missed it."""
    async def main():
        w = NamingDeaf("w0")
        await w.start()
        router, runner, url = await start_router([w])
        try:
            async with ClientSession() as s:
                w.steps = 30
                await leave_early(s, url, "/v1/completions", {"prompt": "a b", "request_id": "r1"},
                                  headers={"X-Request-Id": ""}, worker=w)
                await until(lambda: w.aborted == 1, timeout_s=5)
                assert w.headers == [""] and w.named == [["cmpl--0"]]
                assert [p["request_ids"] for p in distinct(w.abort_posts)] == [["cmpl--0"]]
                assert w.aborted == 1 and router._names == {}
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())


# --- D6: requests that run no inference ------------------------------------------------------------
def test_requests_that_run_no_inference_are_not_in_the_planners_request_rate():
    """``GET /version``, ``/tokenize``, ``/detokenize`` and ``/v1/messages/count_tokens`` run no
    engine request, but counted in ``kvtier_router_requests_total``, which the live planner reads
    as its request rate: a monitor polling ``/version`` each second sized the fleet for 1 more
    request/s. They are counted apart (``kvtier_router_no_inference_requests``). The planner's
    own scrape and observation of the router over a 10 s interval see one request: the
    control, an embedding, which does run the model."""
    async def main():
        async with recorders_router(["a"]) as ([w], router, url, s):
            before = RouterCounters.from_samples(0.0, await asyncio.to_thread(scrape, url))
            for _ in range(10):
                async with s.get(url + "/version") as r:
                    assert r.status == 200
            for path in ("/tokenize", "/detokenize", "/v1/messages/count_tokens", "/v1/embeddings"):
                async with s.post(url + path, json={"model": "tiny", "prompt": "a b"}) as r:
                    assert r.status == 200
            samples = await asyncio.to_thread(scrape, url)
            after = RouterCounters.from_samples(10.0, samples)
            return observation_between(before, after, output_tokens=1), samples
    obs, samples = run(main())
    assert obs is not None and obs.request_rate == pytest.approx(0.1), obs
    assert samples.get("kvtier_router_requests_total") == 1
    assert samples.get("kvtier_router_routed_unknown_length_requests_total") == 1
    assert samples.get("kvtier_router_no_inference_requests_total", status="200") == 13
