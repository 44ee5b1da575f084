"""A completion's prompt embeddings are engine requests of their own: vLLM runs its
``prompt_embeds`` (one, or each of a list) and then its prompts, each as ``cmpl-<id>-<i>`` in that
order (vllm/renderers/online_renderer.py ``preprocess_completion``). The router's abort of a
departed client names them all (audit s33 a5 D4: sized on the prompt alone, a batch of embeddings
was aborted by its first id only). Real ``Router`` app over real sockets, a stand-in worker."""

from __future__ import annotations

import pytest
from aiohttp import ClientSession

from kvtier.router.abort import engine_request_ids
from tests.router.test_http import leave_early, run, start_router, until
from tests.router.test_retry_under_an_aborted_id import Hung


@pytest.mark.parametrize("body, count", [
    ({"prompt_embeds": ["AAAA", "BBBB", "CCCC"]}, 3),
    ({"prompt_embeds": "AAAA"}, 1),
    ({"prompt_embeds": "AAAA", "prompt": ["x y", "z w"]}, 3),
    ({"prompt_embeds": ["AAAA", "BBBB"], "prompt": "x y"}, 3),
    ({"prompt_embeds": ["AAAA"], "prompt": [1, 2, 3]}, 2),
    ({"prompt": ["x y", "z w"]}, 2),
    ({"prompt": "x y"}, 1),
])
def test_the_engine_ids_of_a_completion_count_its_embeddings_then_its_prompts(body, count):
    assert engine_request_ids("/v1/completions", "r1", body) == [f"cmpl-r1-{i}" for i in range(count)]


@pytest.mark.parametrize("body, count", [
    ({"prompt_embeds": ["AAAA", "BBBB", "CCCC"], "max_tokens": 500}, 3),
    ({"prompt_embeds": "AAAA", "prompt": ["x y", "z w"], "max_tokens": 500}, 3),
])
def test_a_departed_clients_batch_of_embeddings_is_aborted_whole(body, count):
    async def main():
        w = Hung("w0")
        await w.start()
        router, runner, url = await start_router([w], abort_again_s=())
        try:
            async with ClientSession() as s:
                await leave_early(s, url, "/v1/completions", body, headers={"X-Request-Id": "r1"}, worker=w)
                await until(lambda: w.abort_posts, timeout_s=5)
            assert w.abort_posts and w.abort_posts[0]["request_ids"] == [f"cmpl-r1-{i}" for i in range(count)]
        finally:
            w.release.set()
            await runner.cleanup()
            await w.stop()
    run(main())
