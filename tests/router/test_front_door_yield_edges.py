"""The youngest-body-yields rule of the router's body bounds, at its edges (regression audit s28).

* A piece that cannot fit even with every younger body gone refuses no one but its own body
  (it made every younger body yield first, for nothing).
* A body made to yield after its end was read is refused, never served with its bytes uncounted.
"""
from __future__ import annotations

import asyncio

from aiohttp import StreamReader

from kvtier.router.reads import BodyBytes, RequestError, _read_pieces
from tests.router.test_front_door_concurrent_uploads import Reader, token_prompt  # noqa: F401
from tests.router.test_http import run, start_router


async def _until(cond, what: str, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def _open(url: str, body: bytes):
    host, port = url.rsplit("/", 1)[-1].split(":")
    r, w = await asyncio.open_connection(host, int(port))
    w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    await w.drain()
    return r, w


async def _status(r: asyncio.StreamReader) -> int:
    line = await asyncio.wait_for(r.readline(), 10)
    return int(line.split()[1]) if line else -1


def test_a_younger_body_is_not_refused_when_its_bytes_cannot_make_the_piece_fit():
    """D1: an older body whose piece does not fit even with every younger body gone makes them all
    yield anyway, then is refused itself: a small body that fit (and was answered 200 before
    7cbece3) is answered 429 for nothing. Per-address share 100 000 bytes, one address (a proxy's
    clients share it): O holds 80 000 (of 90 000), A 10 000 (of 90 000), small B 2 000 (of
    ~5 000); A's next 20 000 cannot fit with or without B's 2 000."""
    o_body, a_body, b_body = token_prompt(90_000), token_prompt(90_000), token_prompt(5_000)

    async def main():
        w = Reader("w0")
        await w.start()
        router, runner, url = await start_router(
            [w], max_body_bytes=100_000, max_form_body_bytes=100_000, max_inflight_body_bytes=64 << 20,
            max_arriving_body_bytes_per_peer=100_000)
        arriving = lambda: router.bodies.arriving("127.0.0.1")  # noqa: E731
        socks = []
        try:
            ro, wo = await _open(url, o_body); socks.append(wo)
            wo.write(o_body[:80_000]); await wo.drain()
            await _until(lambda: arriving() >= 80_000, "O's 80 000 bytes")
            ra, wa = await _open(url, a_body); socks.append(wa)
            wa.write(a_body[:10_000]); await wa.drain()
            await _until(lambda: arriving() >= 90_000, "A's 10 000 bytes")
            rb, wb = await _open(url, b_body); socks.append(wb)
            wb.write(b_body[:2_000]); await wb.drain()
            await _until(lambda: arriving() >= 92_000, "B's 2 000 bytes")
            wa.write(a_body[10_000:30_000]); await wa.drain()
            assert await _status(ra) == 429            # A cannot fit: refused (as before)
            wb.write(b_body[2_000:]); await wb.drain()  # 80 000 + ~5 000 fits the share
            wo.write(o_body[80_000:]); await wo.drain()
            assert await _status(ro) == 200
            assert await _status(rb) == 200, "B was made to yield although its bytes could not make A's piece fit"
        finally:
            for s in socks:
                s.close()
            await runner.cleanup()
            await w.stop()
    run(main())


class _Proto:
    """What a StreamReader needs of its protocol (no flow control is reached here)."""
    _reading_paused = False
    connected = True

    def pause_reading(self, **kw):
        pass

    def resume_reading(self, **kw):
        pass


def test_a_body_made_to_yield_after_its_eof_was_fed_is_not_served_uncounted():
    """D2: a victim whose ``readany`` has already been woken by its EOF (its task ready but not
    run: the last chunk and another client's piece arrive in one loop turn) reads b"" on, is
    "arrived" and its request is served with its bytes given back: held undercounts by its size
    for as long as its answer lasts (max_inflight_body_bytes exceeded). It must either be refused
    (429) or stay counted."""
    async def main():
        loop = asyncio.get_running_loop()
        bodies = BodyBytes(limit=100, per_peer=1 << 30)
        older = bodies.hold("10.0.0.1")
        older.start(StreamReader(_Proto(), 1 << 16, loop=loop))
        assert older.take(50)
        victim = bodies.hold("10.0.0.2")
        content = StreamReader(_Proto(), 1 << 16, loop=loop)
        victim.start(content)
        task = asyncio.ensure_future(_read_pieces(content, victim, 1000))
        content.feed_data(b"x" * 40)
        for _ in range(5):
            await asyncio.sleep(0)
        assert bodies.held == 90 and not task.done()   # the victim's 40 counted, it waits for more
        content.feed_eof()                              # its body is complete: its read is woken ...
        assert older.take(30)                           # ... but before it runs, an older piece needs room
        try:
            body = await task
        except RequestError as exc:
            assert exc.status == 429                    # refused: fine
            return
        # served: its bytes must still be counted
        assert len(body) == 40
        assert bodies.held >= 50 + 30 + 40, (
            f"a {len(body)}-byte body is being served while the router counts held={bodies.held} "
            f"(limit {bodies.limit}): it was released as a victim and then completed")
    run(main())
