"""The logger of the router's aiohttp server: an HTTP message its parser rejects is a client's mistake.

aiohttp answers such a message (a header over 8,190 bytes, a bad ``Content-Length`` or chunk
size, a request line that is no HTTP) with a 400 itself, before any handler of ours runs, and
logs it as ``Error handling request`` at ERROR with a traceback: one traceback per bad message
a client cares to send, and an alarm that says the router failed when it did not. vLLM's own
server (uvicorn) logs one warning line for the same. Here too: one line, at WARNING, that says
what was wrong; anything else aiohttp logs as an exception (a fault of the router's) keeps its
traceback.
"""

from __future__ import annotations

import logging
import sys

from aiohttp.http_exceptions import HttpProcessingError

#: the longest part of the parser's message kept in the log line (it quotes the client's bytes)
QUOTE_CHARS = 200


class ServerLog(logging.LoggerAdapter):
    """What aiohttp's ``RequestHandler`` is given as its ``logger``."""

    def exception(self, msg, *args, exc_info=True, **kwargs) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if isinstance(exc, HttpProcessingError) and 400 <= (exc.code or 400) < 500:
            text = " ".join(str(exc.message or type(exc).__name__).split())
            if len(text) > QUOTE_CHARS:
                text = text[:QUOTE_CHARS] + "..."
            peer = args[-1] if args else "?"   # aiohttp's: ("Error handling request from %s", peer)
            self.warning("answered %d to a malformed HTTP request from %s: %s", exc.code or 400, peer, text)
            return
        super().exception(msg, *args, exc_info=exc_info, **kwargs)


def server_log() -> ServerLog:
    return ServerLog(logging.getLogger("kvtier.router.http"), {})
