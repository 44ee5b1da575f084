"""The router's bounded reads: a client's request body within a deadline, and a worker's answer
that the router holds whole (a 404 it looks into, a listing, a rendering, a LoRA answer) up to a
cap. A relayed answer is never held whole (router/relay.py); these are the reads that were, and a
worker (or a proxy in front of one) whose 404 ran to 300 MiB grew the router by ~1 GiB.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import StreamReader, web

from kvtier.router.requests import RequestError

#: a worker's error answer the router looks into (a 404 for a model), or a LoRA load's answer:
#: vLLM's are a few hundred bytes
SMALL_ANSWER_BYTES = 64 << 10
#: a worker's ``/v1/models`` listing (every LoRA adapter it serves: ~300 bytes each)
LISTING_BYTES = 1 << 20


class AnswerTooLarge(ValueError):
    """A worker's answer ran past what the router reads of it (a ValueError: a bad answer)."""


async def read_capped(content: StreamReader, cap: int) -> tuple[bytes, bool]:
    """What ``content`` holds, read up to ``cap`` bytes and one more: ``(bytes, complete)``.
    Incomplete, the bytes are the answer's first ``cap + 1``, for the caller to relay on."""
    buf = bytearray()
    while len(buf) <= cap:
        chunk = await content.read(cap + 1 - len(buf))
        if not chunk:
            return bytes(buf), True
        buf += chunk
    return bytes(buf), False


async def answer_json(resp, cap: int) -> Any:
    """A worker's JSON answer, read whole only within ``cap`` bytes (else :class:`AnswerTooLarge`);
    a body that is no JSON raises ValueError (or RecursionError, nested too deeply)."""
    data, complete = await read_capped(resp.content, cap)
    if not complete:
        raise AnswerTooLarge(f"the answer is larger than {cap} bytes")
    return json.loads(data)


async def read_body(request: web.Request, timeout_s: float, max_bytes: int) -> bytes:
    """The client's request body, in ``timeout_s`` at most from when its reading began (408 after;
    a client that sends its headers and then nothing, or a byte now and then, otherwise holds a
    connection and a handler for ever), and no larger than the app's ``client_max_size``,
    ``max_bytes`` (413)."""
    try:
        return await asyncio.wait_for(request.read(), timeout_s)
    except asyncio.TimeoutError:
        raise body_too_late(timeout_s) from None
    except web.HTTPRequestEntityTooLarge:
        raise RequestError(413, f"the request body is larger than the router takes (max_body_bytes = "
                                f"{max_bytes})") from None


def body_too_late(timeout_s: float) -> RequestError:
    """The error of a body not read whole within ``timeout_s``: a 408, and the connection closed."""
    return RequestError(408, f"the request body did not arrive within {timeout_s:g} s", "timeout_error", close=True)
