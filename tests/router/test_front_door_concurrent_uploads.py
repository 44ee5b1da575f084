"""Concurrent uploads that together pass a bound: the youngest body yields, the oldest finish.

Regression audit s28 F1: with bodies counted piece by piece, each took part of the share, none
could finish, and every one was answered 429 (a batch client's 17 concurrent 8 MiB prompts under
the default settings: 17 of 17 429; every one 200 before the bound existed). The youngest body
still arriving now yields (429, its bytes given back at once) until the piece fits."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from aiohttp import ClientSession, TCPConnector, web

from tests.router.test_http import StandIn, run, start_router


class Reader(StandIn):
    """Reads a completion's whole body (past aiohttp's 1 MiB client_max_size) and answers at once."""

    async def complete(self, request):
        await request.content.read()
        self.requests += 1
        return web.json_response({"id": "x", "choices": [{"text": "a"}],
                                  "usage": {"prompt_tokens": 4, "completion_tokens": 1}})


def token_prompt(nbytes: int) -> bytes:
    """A completion of a prompt of token ids, ``nbytes`` long (give or take 8)."""
    one = b"123456, "
    return b'{"max_tokens": 1, "prompt": [' + one * (nbytes // len(one) - 1) + b'123456]}'


async def post_all(url: str, bodies: list[tuple[str, bytes]]) -> list:
    sessions: dict[str, ClientSession] = {}
    try:
        for source, _ in bodies:
            if source not in sessions:
                sessions[source] = ClientSession(connector=TCPConnector(local_addr=(source, 0), limit=0))

        async def one(source: str, body: bytes):
            try:
                async with sessions[source].post(url + "/v1/completions", data=body,
                                                 headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    return r.status
            except Exception as exc:  # noqa: BLE001
                return type(exc).__name__
        return await asyncio.gather(*(one(source, body) for source, body in bodies))
    finally:
        for s in sessions.values():
            await s.close()


@pytest.mark.parametrize("case", ["one address, its share", "many addresses, the whole budget"])
def test_concurrent_uploads_past_a_bound_are_not_all_refused(case):
    """Six concurrent 1 MiB bodies where the bound (2 MiB: ``max_arriving_body_bytes_per_peer``
    for one address; ``max_inflight_body_bytes`` for six addresses) holds two of them whole. The
    bodies that fit are taken (at least 2 answered 200; the others 429, to retry later)."""
    size = 1 << 20
    body = token_prompt(size)
    if case.startswith("one"):
        limits = dict(max_body_bytes=size + 64, max_form_body_bytes=size + 64, max_inflight_body_bytes=64 << 20,
                      max_arriving_body_bytes_per_peer=2 * size + 128)
        sources = ["127.0.0.1"] * 6
    else:
        limits = dict(max_body_bytes=size + 64, max_form_body_bytes=size + 64, max_inflight_body_bytes=2 * size + 128)
        sources = [f"127.0.0.{i}" for i in range(2, 8)]

    async def main():
        w = Reader("w0")
        await w.start()
        router, runner, url = await start_router([w], **limits)
        try:
            got = Counter(await post_all(url, [(src, body) for src in sources]))
            assert got[200] >= 2, (f"6 concurrent {len(body)}-byte bodies under a bound that holds 2 whole: "
                                   f"{dict(got)}")
            await asyncio.sleep(0.2)
            assert router.bodies.held == 0
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())


def test_a_batch_of_17_concurrent_8mib_prompts_under_the_default_settings():
    """The brief's client under the defaults (``max_arriving_body_bytes_per_peer`` an eighth of
    1 GiB): 17 concurrent 8 MiB prompts of token ids from one address; at most the youngest
    yield (all 17 were 429)."""
    body = token_prompt(8 << 20)

    async def main():
        w = Reader("w0")
        await w.start()
        router, runner, url = await start_router([w])
        try:
            got = Counter(await post_all(url, [("127.0.0.1", body)] * 17))
            assert got[200] >= 15, f"17 concurrent 8 MiB prompts from one address: {dict(got)}"
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())
