"""A client that leaves while sending its body is no error in the router's log.

Regression audit s28 F2: with bodies read piece by piece, each such client put an ERROR line and a
traceback ("Error handling request ... ConnectionResetError: Connection lost") in the log (one
line per connection, for anyone to fill it; tests/router/test_http.py holds the router to "a
client gone is no error in the router's log")."""

from __future__ import annotations

import asyncio
import logging
import socket

from tests.router.test_front_door import HeldWorker
from tests.router.test_http import run, start_router, until


def test_a_client_leaving_mid_body_is_no_error_in_the_routers_log(caplog):
    async def main():
        w = HeldWorker("w0")
        await w.start()
        router, runner, url = await start_router([w], max_body_bytes=1000)
        port = int(url.rsplit(":", 1)[1])
        try:
            for _ in range(3):
                sock = socket.create_connection(("127.0.0.1", port))
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{" + b" " * 500)
                await until(lambda: router.bodies.held == 501)
                sock.close()
                await until(lambda: router.bodies.held == 0)
                await asyncio.sleep(0.1)
        finally:
            await runner.cleanup()
            await w.stop()

    with caplog.at_level(logging.DEBUG):
        run(main())
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, (f"{len(errors)} ERROR records for 3 clients that left mid-body, e.g. "
                        f"{errors[0].name}: {errors[0].getMessage()} / {errors[0].exc_info and errors[0].exc_info[1]!r}")
