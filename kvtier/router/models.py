"""Which worker serves which model: each worker's own ``/v1/models``.

A fleet need not serve the same names on every worker. A LoRA adapter is often loaded on some
workers only (vLLM's ``--lora-modules``, or ``/v1/load_lora_adapter`` at run time, bounded per
worker by ``--max-loras``), and a worker may carry its own ``--served-model-name``. vLLM answers
a request for a model it does not serve with a 404 (``param: model``), so a router that routes
on cache and load alone sends such a request, with N workers of which one serves it, to a 404
N-1 times in N. Here a request goes only to the workers that list its model; a worker not yet
asked (or whose listing failed) may serve anything. A listing can be stale (an adapter loaded
or unloaded since): a worker's 404 for the model drops the name from its listing, the request is
tried on another worker, and the listings are asked again.

A worker is also asked, once per listing it changes to, how it tokenizes a check text
(:func:`tokenizes_alike`): the router keys requests with its own ``--model-path`` tokenizer and
the workers' blocks from their events' token ids, so a worker serving another model or
tokenizer revision could never be predicted a hit, and the router would route on load alone
without a sign why.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Iterable, Sequence

from aiohttp import ClientError, ClientSession, ClientTimeout

from kvtier.router.reads import SMALL_ANSWER_BYTES, answer_json, read_capped

#: vLLM's model-management endpoints, sent to every worker (``/v1/models`` then lists the
#: adapter on each): a router is one front door, and its clients cannot reach the workers
LORA_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


def _entries(listing: Any) -> list[dict] | None:
    """The model entries of a ``/v1/models`` answer that have an id (None: not a listing)."""
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        return None
    return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]


def listed_models(listing: Any) -> frozenset[str] | None:
    """The model ids a ``/v1/models`` answer lists (None: not a listing)."""
    entries = _entries(listing)
    return None if entries is None else frozenset(m["id"] for m in entries)


def lora_adapters(listing: Any) -> list[str]:
    """The ids a listing names as LoRA adapters: models with a ``parent`` other than themselves."""
    return [m["id"] for m in _entries(listing) or () if m.get("parent") and m.get("parent") != m["id"]]


def merge_listings(listings: Iterable[Any]) -> dict:
    """One ``/v1/models`` answer for the fleet: every model some worker lists, once (as the first
    worker to list it describes it)."""
    seen: dict[str, dict] = {}
    for listing in listings:
        for m in _entries(listing) or ():
            seen.setdefault(m["id"], m)
    return {"object": "list", "data": list(seen.values())}


def requested_model(body: Any) -> str | None:
    """The ``model`` a request body names (None: none, or not a name)."""
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) and model else None


def serving(workers: Sequence, model: str | None) -> list:
    """Those of ``workers`` that may serve ``model``: they list it, or have not been asked. When
    none may (a name no worker lists, or listings gone stale), all of them: a worker then answers
    for itself, with vLLM's own error if nobody serves the name."""
    if model is None:
        return list(workers)
    able = [w for w in workers if w.models is None or model in w.models]
    return able or list(workers)


def model_missing(status: int, body: bytes) -> bool:
    """A worker's answer says it does not serve the request's model (vLLM: 404, ``param: model``)."""
    if status != 404:
        return False
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError, RecursionError):
        return False
    if not isinstance(error, dict):
        return False
    message = error.get("message")
    return error.get("param") == "model" or (isinstance(message, str) and message.startswith("The model `")
                                              and message.endswith("` does not exist."))


async def post_to_all(session: ClientSession, workers: Sequence, path: str, raw: bytes, headers: dict,
                      timeout_s: float) -> list[tuple[Any, int, bytes, str]]:
    """POST ``raw`` to ``path`` on every worker at once: (worker, status, body, content type) each;
    a worker that cannot be reached, or whose answer runs past ``SMALL_ANSWER_BYTES`` (vLLM's are
    a line; each is held whole), is a 502 of the OpenAI shape."""
    def bad_gateway_of(w, message: str) -> tuple[Any, int, bytes, str]:
        error = {"error": {"message": message, "type": "bad_gateway", "param": None, "code": 502}}
        return w, 502, json.dumps(error).encode(), "application/json"

    async def send(w) -> tuple[Any, int, bytes, str]:
        try:
            async with session.post(w.url + path, data=raw, headers=headers,
                                    timeout=ClientTimeout(total=timeout_s)) as resp:
                data, complete = await read_capped(resp.content, SMALL_ANSWER_BYTES)
                if not complete:
                    return bad_gateway_of(w, f"the worker's answer ({resp.status}) is larger than "
                                             f"{SMALL_ANSWER_BYTES} bytes")
                return w, resp.status, data, resp.content_type
        except (ClientError, asyncio.TimeoutError, OSError) as exc:
            return bad_gateway_of(w, f"{exc.__class__.__name__}: {exc}")

    return list(await asyncio.gather(*(send(w) for w in workers)))


def first_refusal(answers: Sequence[tuple[Any, int, bytes, str]]) -> tuple[int, str] | None:
    """(status, message naming the worker and how many succeeded) of the first answer that is not
    a 200, or None when all are."""
    failed = [(w, status, data) for w, status, data, _ in answers if status != 200]
    if not failed:
        return None
    w, status, data = failed[0]
    try:
        error = json.loads(data)["error"]
        message = error["message"] if isinstance(error, dict) else str(error)
    except (ValueError, KeyError, TypeError, RecursionError):
        message = data.decode("utf-8", "replace")[:500]
    done = len(answers) - len(failed)
    return status, f"worker {w.url}: {message} ({done} of {len(answers)} workers succeeded)"


#: what the router and a worker both tokenize to check that they agree: words, digits,
#: punctuation, whitespace runs and non-ASCII, where tokenizers differ first
TOKENIZER_CHECK_TEXT = ("kvtier checks its tokenizer: The quick brown fox jumps over 13 lazy dogs, "
                        "3.14159 \u00fcber na\u00efve caf\u00e9s \u2014 \u65e5\u672c\u8a9e\t\t end.\n  ok?")


async def tokenizes_alike(session: ClientSession, worker, headers: dict | None, expected: list[int],
                          timeout_s: float = 5.0) -> bool | None:
    """Whether ``worker`` (vLLM's ``/tokenize``) turns :data:`TOKENIZER_CHECK_TEXT` into
    ``expected``, the router's own ids for it; None if it could not say (no such endpoint, down)."""
    try:
        async with session.post(worker.url + "/tokenize", json={"prompt": TOKENIZER_CHECK_TEXT}, headers=headers,
                                timeout=ClientTimeout(total=timeout_s)) as resp:
            answer = await answer_json(resp, SMALL_ANSWER_BYTES) if resp.status == 200 else None
    except (ClientError, asyncio.TimeoutError, ValueError, RecursionError):
        return None
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    if not isinstance(tokens, list):
        return None
    return tokens == list(expected)
