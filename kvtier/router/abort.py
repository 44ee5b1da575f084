"""A client that leaves: noticing it, and aborting its request on the worker.

Noticing: aiohttp cancels a handler whose client closed its connection (``handler_cancellation``)
when its event loop reads the end of the stream. While a request waits for its worker's first
byte the router writes nothing to the client, so that is the only sign; as a second one, it also
looks at the client's socket itself (:func:`watch_client`: a FIN or a reset waiting there), which
needs no read to be scheduled. (Measured here, some departures were acted on only when the answer
came back; in every one examined the router's process itself had stood still for 4-6 s, using no
CPU, which no code in it can help: BENCHMARKS.md.)

Closing the worker's connection ought to be enough: vLLM aborts a generation whose client
is gone. It does not always do so in time:
- vLLM 0.32 may decode a *non-streamed* request to ``max_tokens`` after its client's
  connection closed (vllm-project/vllm#54947; 2 of 4 tries in one measurement here, on a
  machine that also stalls whole processes now and then);
- an API server short of CPU (its engine on the same cores) notices a closed stream only
  when its event loop comes round, seconds later: measured here, a 1,900-token stream was
  decoded whole before the worker had even sent its first event.

So the router names every request it forwards (``X-Request-Id``, which vLLM turns into its
engine request ids, unless the client named it: :func:`request_id`) and, when the client
leaves, also asks the worker to abort those ids (``POST /inference/v1/abort_requests``,
vLLM's endpoint for routers; behind ``--api-key`` with the client's own credentials). An id
the worker no longer runs is a no-op there; a worker without the endpoint answers 404,
counted and otherwise harmless.

An id the worker does not run *yet* is a no-op too, and it answers 200 all the same: vLLM
registers a request only once its API server has processed it, which beside a decoding
engine on two cores took seconds. Measured on one real worker, an abort sent with the
request was lost 3 times in 3 (6,000 of 6,000 tokens decoded for nobody), and through the
router 2 departures in 8 were. So a client that leaves before its worker's first byte (the
only case where the worker may not have it yet) has the abort sent again later
(``abort_again_s``; unless its client-given id names another request under way by then).

The Responses API is left out: a ``background`` response must outlive its client.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import re
import socket
import uuid
from collections import Counter
from typing import Any, Callable, Iterable, Mapping, NamedTuple

from aiohttp import ClientError, ClientSession, ClientTimeout, ServerDisconnectedError, TCPConnector

from kvtier.router.requests import is_batch

log = logging.getLogger(__name__)

ABORT_PATH = "/inference/v1/abort_requests"
#: vLLM's external request id per endpoint, from the X-Request-Id header: a completion has
#: one engine request per prompt (``cmpl-<id>-<i>``), a chat one (``chatcmpl-<id>``)
_PREFIX = {"/v1/completions": "cmpl-", "/v1/chat/completions": "chatcmpl-",
           "/v1/messages": "chatcmpl-"}   # (vLLM serves the Messages API as a chat)
#: how long an abort waits for the worker's answer. Long, since it runs in the background and a
#: worker's API server beside a decoding engine on the same cores may answer seconds late: a CI
#: run here saw an abort that cut its generation (2,231 of 16,000 tokens) counted ``failed``
#: under the 5 s this was, and a worker's /metrics once took 31 s. An abort the worker takes
#: late still stops its decoding, so it is waited for and counted ``ok``.
ABORT_TIMEOUT_S = 30.0
#: the most engine requests one abort names: a larger batch is left to its closed connection,
#: since its ids would be megabytes of JSON to build and send (a completion batch's size is
#: bounded only by the body's)
MAX_ABORT_IDS = 1024
#: the most bytes one abort's JSON body may take, whatever its count: each id repeats the request's
#: name, and a 250 KB body ``request_id`` on a batch of 1,024 prompts made a 256 MB abort, built
#: and encoded on the event loop (every stream stalled 2.5 s) and posted to the worker (audit s31
#: a4 D2). Sized on the names clients give, not on the router's own (a 32-hex uuid: ~48 KiB at
#: MAX_ABORT_IDS): 1,024 ids under a name of up to ~1,000 characters (a 64-hex trace id or
#: idempotency key needs ~80 KiB: at 64 KiB such a batch went unaborted, audit s31 r3 D3), or the
#: longest name kept (MAX_KEPT_ID_CHARS) on a batch of ~120. Over ENCODE_INLINE_BYTES it is built
#: and encoded on a thread (:func:`abort_body`).
MAX_ABORT_BYTES = 1 << 20
#: the most bytes of abort bodies the router holds at once (their :meth:`EngineIds.abort_bytes`):
#: each is held while it is posted, until the worker answers (up to ABORT_TIMEOUT_S), and a ~9 KB
#: request (an 8,000-character id over 120 empty prompts) makes a ~1 MiB one: 40 departures held
#: 37 MiB, counted in no bound (audit s32 a1 D2). An abort over it is not sent (``over_budget``):
#: its closed connection is what tells the worker, as for one too large to name. Sixteen of the
#: largest fit, or some 100,000 of a uuid-named request's. Shared out by :class:`AbortBudget`.
MAX_ABORT_BYTES_IN_FLIGHT = 16 << 20
#: the most of MAX_ABORT_BYTES_IN_FLIGHT the aborts posted to one worker hold: a worker that
#: answers no abort (hung, or its API server short of CPU) holds each body ABORT_TIMEOUT_S, once
#: per post (three for a departure before the first byte: ~90 s), and with the whole bound its
#: departures, or one client's crafted ones, had every other worker's aborts dropped for that
#: long (audit s32 r3 D1). Four of the largest aborts (MAX_ABORT_BYTES); it takes four such
#: workers at once to fill the bound. (A worker's small bodies may hold its share of the reserve
#: beside it.)
MAX_ABORT_BYTES_PER_WORKER = MAX_ABORT_BYTES_IN_FLIGHT // 4
#: the part of MAX_ABORT_BYTES_IN_FLIGHT only small bodies (at most ENCODE_INLINE_BYTES: a chat's
#: ~64 bytes, a uuid-named batch of 1,024) may take, so that they are still posted while the large
#: ones of several slow workers fill the rest; ~16,000 chat aborts
SMALL_ABORT_RESERVE_BYTES = MAX_ABORT_BYTES_IN_FLIGHT // 16
#: the most of SMALL_ABORT_RESERVE_BYTES one worker's small bodies hold, for no slow worker to take
#: the reserve from the others: two of the largest small bodies, or ~2,000 chat aborts
SMALL_ABORT_RESERVE_PER_WORKER = SMALL_ABORT_RESERVE_BYTES // 8
#: an abort's body larger than this is built and encoded on a thread, not on the event loop
ENCODE_INLINE_BYTES = 64 * 1024
#: the longest body ``request_id`` the router keeps as a request's name: as long as a header line
#: aiohttp reads (8,190 bytes), so that a body's id is held no longer than a header's for a
#: stream's whole decode (a 16 MiB one was held, uncounted, after the body was released). No
#: header carries a longer id, so a request left unnamed shares its id with no named one.
MAX_KEPT_ID_CHARS = 8192
#: endpoints whose vLLM request model has a ``request_id`` field, the id vLLM runs the request
#: under when no ``X-Request-Id`` header names it (its Messages API has none: a body's is ignored)
_BODY_NAMED = frozenset({"/v1/completions", "/v1/chat/completions"})
#: the request ids echoed in an answer's ``X-Request-Id``: printable ASCII, no space, at most 256
#: characters (:func:`echoed_id`)
_ECHOED_ID = re.compile(r"[!-~]{1,256}")
#: how often the client's socket is looked at while its request waits on the worker
CLIENT_POLL_S = 0.5


#: what a look at a socket that failed says of the connection itself: it is over
_DEAD = frozenset({errno.ECONNRESET, errno.ECONNABORTED, errno.EPIPE, errno.ETIMEDOUT, errno.ENOTCONN})


def client_gone(transport) -> bool:
    """The client closed its connection: a FIN (reads as end of stream) or a reset waits in the
    socket, whatever the event loop's reader made of it. Pipelined bytes read as alive.

    Looked at through the connection's own descriptor, never a new one: out of descriptors
    (EMFILE, the overload many clients make) a ``dup()`` failed, and taking that for a
    departure cancelled every request then waiting for its first byte. A look that fails for
    any reason but the socket's own state is "not known", which is not "gone"."""
    if transport is None or transport.is_closing():
        return True
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    try:
        # asyncio's socket wrapper has no recv: a socket object over the same descriptor, detached
        # (never closed) after the look, so the connection's descriptor stays the transport's
        peek = socket.socket(fileno=sock.fileno())
    except (OSError, ValueError):
        return False
    try:
        return peek.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError as exc:   # a reset or a dead connection: gone; anything else (no memory): not known
        return exc.errno in _DEAD
    finally:
        peek.detach()


def watch_client(transport, on_gone, interval_s: float = CLIENT_POLL_S) -> asyncio.Task:
    """A task that calls ``on_gone()`` once the client is gone; cancel it when done waiting."""
    async def watch() -> None:
        while True:
            await asyncio.sleep(interval_s)
            if client_gone(transport):
                log.debug("a client left without the server noticing: seen on its socket")
                on_gone()
                return
    return asyncio.get_running_loop().create_task(watch())


def request_id(path: str, headers: Mapping[str, str], body: Any) -> tuple[str | None, bool]:
    """The id the worker will know the request by, and whether the router must send it as a
    header; None: the request goes unnamed, its body's id being too long to keep (over
    :data:`MAX_KEPT_ID_CHARS`). A client's own ``X-Request-Id`` is kept, and so is the body's
    ``request_id`` on an endpoint whose vLLM request has that field (:data:`_BODY_NAMED`; vLLM
    takes it when no header comes): it is how the client finds the request in the worker's logs,
    and vLLM names its answer by it. Neither is sent as a header: the worker reads each where
    the client put it. (A body's id was once sent as the header, and replaced by the router's
    when it was no header value, a space, non-ASCII or over 256 characters: vLLM then named the
    answer by the router's id, audit s30 a4 D5.) Any other request the router names itself, in
    the header. A header is the client's id whenever it is there, an empty one too, as vLLM
    reads it (its ``_base_request_id``: ``is not None``): taken for no id, the router named the
    request by its body's while the worker ran it as ``cmpl--0``, and its abort missed (audit
    s30 a11 D5).

    A body's id over :data:`MAX_KEPT_ID_CHARS` is not kept: vLLM runs the request under it all
    the same (its ``request_id`` field has no bound), so the router can name no other (a header
    would rename the answer) and leaves the request unnamed: only its closed connection tells the
    worker that its client left, as for a batch too large to name (:data:`MAX_ABORT_BYTES`)."""
    given = headers.get("X-Request-Id")
    if given is not None:
        return given, False
    own = body.get("request_id") if path in _BODY_NAMED and isinstance(body, dict) else None
    if isinstance(own, str):
        return (own, False) if len(own) <= MAX_KEPT_ID_CHARS else (None, False)
    return uuid.uuid4().hex, True


def echoed_id(rid: str) -> str | None:
    """``rid`` as the answer's ``X-Request-Id``, or None where it is not a short header-safe token
    (:data:`_ECHOED_ID`). A body's ``request_id`` has no bound on its length nor on what it holds:
    one of 20,000 characters, echoed, made an answer head aiohttp's client (8,190 bytes a field)
    could not read, though the worker had answered (audit s30 a11 D2); a CR or LF would inject a
    header."""
    return rid if _ECHOED_ID.fullmatch(rid) else None


class EngineIds(NamedTuple):
    """The external ids vLLM gives the engine requests of one HTTP request, named but not built:
    a completion batch of N prompts has N (``cmpl-<id>-<i>``), and building them for every
    request, though only an abort uses them, cost ~100 bytes and some event-loop time per prompt
    (a 64 MiB body of empty prompts: ~22 M ids, ~2 GB)."""

    prefix: str
    rid: str
    count: int       #: engine requests
    numbered: bool   #: ``<prefix><rid>-<i>`` each (a completion), else the one ``<prefix><rid>``

    def ids(self) -> list[str]:
        if not self.numbered:
            return [self.prefix + self.rid]
        return [f"{self.prefix}{self.rid}-{i}" for i in range(self.count)]

    def first(self) -> str:
        """The first of :meth:`ids`, built alone."""
        return f"{self.prefix}{self.rid}-0" if self.numbered else self.prefix + self.rid

    def encoded(self) -> bytes:
        """The abort's JSON body naming :meth:`ids`, id by id (on a thread, the GIL goes between
        ids: one ``json.dumps`` of them all holds it until the whole body is encoded)."""
        return b'{"request_ids": [' + b", ".join(json.dumps(i).encode() for i in self.ids()) + b"]}"

    def abort_bytes(self) -> int:
        """The most bytes an abort's JSON body naming :meth:`ids` takes, known without building
        them: the name is encoded once (its characters may be escaped), each id's number at its
        longest."""
        number = len(f"-{self.count - 1}") if self.numbered else 0
        one = len(json.dumps(self.prefix + self.rid)) + number + len(", ")
        return len(json.dumps({"request_ids": []})) + self.count * one


async def abort_body(engine: EngineIds) -> bytes:
    """:meth:`EngineIds.encoded`, on a thread when it is over :data:`ENCODE_INLINE_BYTES`: a body of
    up to :data:`MAX_ABORT_BYTES` built on the event loop would stall every stream the router relays."""
    if engine.abort_bytes() <= ENCODE_INLINE_BYTES:
        return engine.encoded()
    return await asyncio.to_thread(engine.encoded)


def engine_requests(path: str, rid: str | None, body: Any) -> EngineIds | None:
    """The engine requests of one HTTP request (None: the endpoint is not aborted by the router,
    or the request is unnamed: ``rid`` None, :func:`request_id`)."""
    prefix = _PREFIX.get(path)
    if prefix is None or rid is None:
        return None
    if path != "/v1/completions":
        return EngineIds(prefix, rid, 1, False)
    return EngineIds(prefix, rid, completion_inputs(body), True)


def completion_inputs(body: Any) -> int:
    """The engine requests vLLM runs for a completion, numbered in its order (``cmpl-<id>-<i>``):
    its ``prompt_embeds`` first (one, or each of a list), then its prompts (one, or each of a
    batch), as vLLM's ``preprocess_completion`` lists them. Sized on the prompt alone, a batch of
    embeddings was aborted by its first id only, the rest decoding on for nobody (audit s33 a5 D4).
    At least 1: a body vLLM refuses still gets the first id named."""
    if not isinstance(body, dict):
        return 1
    embeds, prompt = body.get("prompt_embeds"), body.get("prompt")
    count = 0
    if embeds is not None:
        count += len(embeds) if isinstance(embeds, list) else 1
    if prompt is not None:
        count += len(prompt) if is_batch(prompt) else 1
    return max(count, 1)


def engine_request_ids(path: str, rid: str, body: Any) -> list[str]:
    """Every external id vLLM gives the engine requests of one HTTP request, built (empty: the
    endpoint is not aborted by the router). The router keeps :func:`engine_requests` instead."""
    engine = engine_requests(path, rid, body)
    return engine.ids() if engine is not None else []


class _Room:
    """One part of :class:`AbortBudget`: the bytes its bodies hold, at most ``total`` in all and
    ``per_worker`` to any one worker URL."""

    __slots__ = ("total", "per_worker", "held", "by_worker")

    def __init__(self, total: int, per_worker: int) -> None:
        self.total, self.per_worker = total, per_worker
        self.held = 0
        self.by_worker: Counter[str] = Counter()   # (a worker that holds nothing has no entry)

    def fits(self, worker_url: str, size: int) -> bool:
        return self.held + size <= self.total and self.by_worker[worker_url] + size <= self.per_worker

    def take(self, worker_url: str, size: int) -> None:
        self.held += size
        self.by_worker[worker_url] += size

    def give_back(self, worker_url: str, size: int) -> None:
        self.held -= size
        self.by_worker[worker_url] -= size
        if self.by_worker[worker_url] <= 0:
            del self.by_worker[worker_url]

    def check_integrity(self) -> None:
        if self.held != sum(self.by_worker.values()) or self.held > self.total or \
                any(not 0 < held <= self.per_worker for held in self.by_worker.values()):
            raise AssertionError(f"abort room: {self.held} of {self.total} held, by worker {dict(self.by_worker)} "
                                 f"(each at most {self.per_worker})")


class AbortBudget:
    """The bytes of the abort bodies posted now (each its ``abort_bytes()``, a bound), shared so
    that no worker and no client takes what the others' aborts need (audit s32 r3 D1):
    ``total_bytes`` in all, of which
    - any body may take what the reserve leaves, at most ``worker_bytes`` to one worker;
    - a body of at most :data:`ENCODE_INLINE_BYTES` that finds no room there takes the reserve,
      ``reserve_bytes``, at most ``reserve_bytes // 8`` to one worker.

    So a small abort to a worker is refused only once that worker holds its own shares, or once
    four workers together hold the shared part (each its ``worker_bytes``) and eight hold the
    reserve. Not thread safe: the event loop's."""

    def __init__(self, total_bytes: int = MAX_ABORT_BYTES_IN_FLIGHT, worker_bytes: int | None = None,
                 reserve_bytes: int | None = None) -> None:
        # (each default a part of the total, as the module's constants are of theirs)
        worker_bytes = total_bytes * MAX_ABORT_BYTES_PER_WORKER // MAX_ABORT_BYTES_IN_FLIGHT \
            if worker_bytes is None else worker_bytes
        reserve_bytes = total_bytes * SMALL_ABORT_RESERVE_BYTES // MAX_ABORT_BYTES_IN_FLIGHT \
            if reserve_bytes is None else reserve_bytes
        if not 0 <= reserve_bytes < total_bytes:
            raise ValueError(f"the small aborts' reserve ({reserve_bytes} bytes) must be part of the "
                             f"abort budget ({total_bytes} bytes)")
        self.total_bytes = total_bytes
        self.shared = _Room(total_bytes - reserve_bytes, worker_bytes)
        self.reserve = _Room(reserve_bytes,
                             reserve_bytes * SMALL_ABORT_RESERVE_PER_WORKER // SMALL_ABORT_RESERVE_BYTES)

    @property
    def held(self) -> int:
        return self.shared.held + self.reserve.held

    def held_by(self, worker_url: str) -> int:
        return self.shared.by_worker[worker_url] + self.reserve.by_worker[worker_url]

    def take(self, worker_url: str, size: int) -> _Room | None:
        """Hold ``size`` bytes for a body posted to ``worker_url``: the room it is held in (to give
        it back to), or None where none has room for it."""
        if self.shared.fits(worker_url, size):
            room = self.shared
        elif size <= ENCODE_INLINE_BYTES and self.reserve.fits(worker_url, size):
            room = self.reserve
        else:
            return None
        room.take(worker_url, size)
        return room

    def check_integrity(self) -> None:
        self.shared.check_integrity()
        self.reserve.check_integrity()


class WorkerAborts:
    """Abort requests sent by the router in the background (the handler that asks is being
    cancelled); ``record(worker_url, result)`` counts each outcome: ``ok``, ``refused`` (the
    worker answered an error status), ``failed`` (no answer), ``again`` (sent again, answered),
    ``over_budget`` (not sent: no room for its body in ``budget``, :class:`AbortBudget`).

    Each post is recorded once, ``over_budget`` too, and the router ends its wait for an abort's
    answer at the record (app.py ``_after_aborts_of``): a post not sent can end no request of its id
    later, so a retry under that id has nothing to wait for. With the shares of :class:`AbortBudget`
    a post to a worker is over budget mostly when that worker itself holds its share unanswered,
    where waiting would be for a worker that answers no abort."""

    def __init__(self, record, budget_bytes: int = MAX_ABORT_BYTES_IN_FLIGHT, worker_bytes: int | None = None,
                 reserve_bytes: int | None = None) -> None:
        self._record = record
        self._pending: set[asyncio.Task] = set()
        self._waiting: set[asyncio.Task] = set()   # asleep until an abort is sent again
        self._refusing: set[str] = set()   # workers told about once
        self.budget = AbortBudget(budget_bytes, worker_bytes, reserve_bytes)
        self.budget_bytes = budget_bytes
        self._over_budget_told = False

    @property
    def bytes_in_flight(self) -> int:
        """The bytes of the abort bodies built and posted now (each its ``abort_bytes()``, a bound)."""
        return self.budget.held

    def send(self, session: ClientSession | None, worker_url: str, ids: EngineIds | None,
             headers: Mapping[str, str] | None, again_after_s: Iterable[float] = (),
             still_wanted: Callable[[], bool] | None = None) -> None:
        """Abort ``ids`` on the worker now, and again ``again_after_s`` seconds from now (each
        time only if ``still_wanted()``; the router's says no once another request of that name is
        on the worker, or once the worker is ejected or removed): ``record`` counts the first as
        ``ok``/``refused``/``failed`` and each one sent again as ``again`` (or its failure); a
        request of more than :data:`MAX_ABORT_IDS` engine requests, or whose ids take more than
        :data:`MAX_ABORT_BYTES`, is not named (``too_many``): its closed connection is what tells
        the worker."""
        if session is None or session.closed or ids is None:
            return
        if ids.count > MAX_ABORT_IDS or ids.abort_bytes() > MAX_ABORT_BYTES:
            self._record(worker_url, "too_many")
            return
        task = asyncio.get_running_loop().create_task(
            self._aborts(session, worker_url, ids, headers, sorted(again_after_s), still_wanted))
        self._pending.add(task)   # held: the loop keeps only weak references to tasks
        task.add_done_callback(self._pending.discard)

    async def _aborts(self, session: ClientSession, worker_url: str, engine: EngineIds,
                      headers: Mapping[str, str] | None, again_after_s: list[float],
                      still_wanted: Callable[[], bool] | None) -> None:
        t0 = asyncio.get_running_loop().time()
        self._record(worker_url, await self._post_built(session, worker_url, engine, headers))
        for at in again_after_s:
            self._waiting.add(asyncio.current_task())
            try:
                await asyncio.sleep(max(0.0, t0 + at - asyncio.get_running_loop().time()))
            finally:
                self._waiting.discard(asyncio.current_task())
            if session.closed or (still_wanted is not None and not still_wanted()):
                return
            result = await self._post_built(session, worker_url, engine, headers)
            self._record(worker_url, "again" if result == "ok" else result)

    async def _post_built(self, session: ClientSession, worker_url: str, engine: EngineIds,
                          headers: Mapping[str, str] | None) -> str:
        # The body is built here, once the client has left, and again for each post (off the loop
        # over ENCODE_INLINE_BYTES): kept between posts, up to MAX_ABORT_BYTES sat in the router
        # through the again-posts' sleeps, counted in no bound (~1 MiB for a ~6 KB request under a
        # long client id, one per departed client: audit s31 r7 D3). Held only while posted now,
        # and only where the budget has room for it (audit s32 a1 D2, s32 r3 D1).
        size = engine.abort_bytes()
        room = self.budget.take(worker_url, size)
        if room is None:
            self._tell_over_budget(worker_url, size)
            return "over_budget"
        try:
            return await self._post(session, worker_url, engine, await abort_body(engine), headers)
        finally:
            room.give_back(worker_url, size)

    def _tell_over_budget(self, worker_url: str, size: int) -> None:
        if self._over_budget_told:   # (once: the count says how often)
            return
        self._over_budget_told = True
        shared = self.budget.shared
        log.warning("worker %s: an abort by name of %d bytes not sent: the abort bodies posted now take %d bytes "
                    "to that worker (%d its share) and %d in all (%d, of which %d only for bodies of at most %d) "
                    "(MAX_ABORT_BYTES_IN_FLIGHT); its closed connection is what tells the worker "
                    "(kvtier_router_worker_aborts_total{result=\"over_budget\"} counts them)",
                    worker_url, size, self.budget.held_by(worker_url), shared.per_worker, self.budget.held,
                    self.budget.total_bytes, self.budget.reserve.total, ENCODE_INLINE_BYTES)

    async def _post(self, session: ClientSession, worker_url: str, engine: EngineIds, body: bytes,
                    headers: Mapping[str, str] | None) -> str:
        # An abort goes out on a pooled keep-alive connection, which the worker may have closed
        # just then: aiohttp says "Server disconnected" without the worker having read it (a full
        # fresh-clone CI run lost an abort so, and the generation ran on). Aborting is idempotent:
        # sent once more, on a connection of its own. Not the pool's next: a worker closes those
        # idle since one burst together (uvicorn's keep-alive timer), and a second stale one lost
        # the abort all the same (audit s31 a4 D4).
        headers = {**(headers or {}), "Content-Type": "application/json"}
        try:
            try:
                return await self._post_on(session, worker_url, body, headers)
            except ServerDisconnectedError:
                async with ClientSession(connector=TCPConnector(force_close=True)) as fresh:
                    return await self._post_on(fresh, worker_url, body, headers)
        except (ClientError, asyncio.TimeoutError, OSError) as exc:
            # the count and the first, not the list: up to MAX_ABORT_BYTES of ids on one line
            log.info("worker %s: aborting %d engine request(s) (%.80s…) failed (%s)",
                     worker_url, engine.count, engine.first(), exc)
            return "failed"

    async def _post_on(self, session: ClientSession, worker_url: str, body: bytes,
                       headers: Mapping[str, str]) -> str:
        async with session.post(worker_url + ABORT_PATH, data=body, headers=headers,
                                timeout=ClientTimeout(total=ABORT_TIMEOUT_S)) as resp:
            if resp.status < 400:
                return "ok"
            if worker_url not in self._refusing:
                self._refusing.add(worker_url)
                # vLLM answers 403 unless started with --enable-scale-out
                log.warning("worker %s refuses to abort requests by name (%s); start it with "
                            "--enable-scale-out, or only a closed connection tells it",
                            worker_url, resp.status)
            return "refused"

    async def drain(self, timeout_s: float = 2.0) -> None:
        """Let the aborts under way finish (at shutdown, before the session closes); those
        waiting to be sent again are not waited for."""
        for task in list(self._waiting):
            task.cancel()
        if self._pending:
            await asyncio.wait(list(self._pending), timeout=timeout_s)
