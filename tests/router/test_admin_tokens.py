"""The router's admin token cannot be guessed without limit (kvtier/router/admin.py).

With ``KVTIER_ROUTER_ADMIN_TOKEN`` set, a wrong bearer token was answered 401 as often as it was
sent: nothing slowed a guesser or told the operator. Now a wrong token is a failed login of the
caller's address, as at the kvtier server: ten at once, then one a second; past that the address
is answered 429 before its token is compared, and the first failures of a burst are logged.
Controls: the right token works before, from another address while one is held back, and again
once the bucket refills; a call without a token is no guess. Real sockets: a stand-in worker and
the real router app.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import ClientSession, TCPConnector

from kvtier.router.admin import TOKEN_ENV
from tests.router.test_http import StandIn, run, start_router


async def _list(url: str, token: str | None, source: str = "127.0.0.1") -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with ClientSession(connector=TCPConnector(local_addr=(source, 0))) as s:
        async with s.get(url + "/admin/workers", headers=headers) as r:
            await r.read()
            return r.status


def test_wrong_admin_tokens_are_throttled_per_address_and_logged(monkeypatch, caplog):
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    caplog.set_level(logging.WARNING, logger="kvtier.router.admin")

    async def main():
        a = StandIn("a")
        await a.start()
        router, runner, url = await start_router([a])
        try:
            assert await _list(url, "s3cret") == 200                       # control
            assert await _list(url, None) == 401                           # no guess: not charged
            t0 = asyncio.get_running_loop().time()
            codes = [await _list(url, f"guess-{i}") for i in range(40)]
            refilled = asyncio.get_running_loop().time() - t0              # one try a second given back
            assert codes[:10] == [401] * 10 and set(codes) == {401, 429} and codes.count(401) <= 10 + refilled + 1, codes
            assert await _list(url, "s3cret") == 429                       # not even compared
            assert await _list(url, "s3cret", source="127.0.0.2") == 200   # another address is not held
            await asyncio.sleep(1.2)                                       # one more try a second
            assert await _list(url, "s3cret") == 200
        finally:
            await runner.cleanup()
            await a.stop()
    run(main())
    warned = [r for r in caplog.records if "wrong bearer token from 127.0.0.1" in r.getMessage()]
    assert 1 <= len(warned) <= 3, [r.getMessage() for r in caplog.records]
    assert not any("guess" in r.getMessage() or "s3cret" in r.getMessage() for r in caplog.records)
