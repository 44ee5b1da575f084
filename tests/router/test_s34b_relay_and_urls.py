"""A stream is relayed in whole events whatever line ends its worker writes (audit s34 r4 D1), at a
cost linear in its bytes (D2); a worker URL is named one way by the router, the planner's local
launcher and ``kvtier top`` alike (D3), its scheme's default port left out (D4). Real ``Router``
app over real sockets; the workers are test_s34_stream_cut_events.py's few lines of aiohttp."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time

import pytest
from aiohttp import ClientSession, ClientTimeout, web

from kvtier.errors import ConfigError
from kvtier.planner.local_launcher import LocalLauncher, RouterAdmin, WorkerTemplate
from kvtier.router.app import Router
from kvtier.router.config import RouterConfig, WorkerSpec, normal_url
from kvtier.router.relay import HELD_EVENT_BYTES, WholeEvents
from tests.router.test_http import WordTokenizer, free_port, run, until
from tests.router.test_s34_stream_cut_events import HALF, Worker, _serving

pytestmark = pytest.mark.timeout(120)

#: the line ends SSE lets each line choose
LINE_END = re.compile(rb"\r\n|\r|\n")


def _token(text: str, end: bytes) -> bytes:
    """One completion event, its data line and the blank line after it ending in ``end``."""
    return f'data: {{"choices": [{{"index": 0, "text": "{text}"}}]}}'.encode() + end


def _sse_events(raw: bytes) -> list[str]:
    """Each event's data, read as an SSE client reads a stream (any line end; a blank line ends an event)."""
    events, data = [], []
    for line in LINE_END.split(raw):
        if not line:
            if data:
                events.append("\n".join(data))
            data = []
        elif line.startswith(b"data:"):
            data.append(line[len(b"data:"):].lstrip().decode())
    return events


async def _arrivals(url: str) -> list[tuple[float, bytes]]:
    """A stream's bytes as its client reads them, each read with its time from the request."""
    got = []
    async with ClientSession() as s:
        t0 = time.monotonic()
        async with s.post(url + "/v1/completions", json={"prompt": "a b", "stream": True},
                          timeout=ClientTimeout(total=20)) as r:
            assert r.status == 200
            async for data in r.content.iter_any():
                got.append((time.monotonic() - t0, data))
    return got


# --- D1: events ended by mixed line ends ------------------------------------------------------
MIXED_ENDS = pytest.mark.parametrize("end", [b"\n\r\n", b"\n\r", b"\r\r\n"], ids=["LF-CRLF", "LF-CR", "CR-CRLF"])


@MIXED_ENDS
def test_an_event_ended_by_mixed_line_ends_reaches_the_client_as_it_comes(end):
    """Before: ``data: x\\n`` and a blank line ``\\r\\n`` (or ``\\r``) was no event end to the
    router, which held the whole stream until its worker ended it: the first token came with
    the last, 1.2 s late."""
    async def main():
        w = Worker([_token("A", end), _token("B", end) + b"data: [DONE]" + end], end="done", gap_s=1.2)
        router, runner, url = await _serving(w)
        try:
            got = await _arrivals(url)
            first = next(t for t, data in got if b'"A"' in data)
            assert first < 0.8, f"the first token reached the client {first:.2f} s after the request"
            assert b"".join(d for _, d in got) == b"".join(w.pieces)
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())


@MIXED_ENDS
def test_a_worker_that_dies_after_events_with_mixed_line_ends_leaves_them_with_the_client(end):
    """Before: the router held every such event; the worker's death dropped them all, and the
    client got the error event alone."""
    async def main():
        w = Worker([_token("A", end), _token("B", end), _token("C", end), HALF])
        router, runner, url = await _serving(w)
        try:
            raw = b"".join(d for _, d in await _arrivals(url))
            events = _sse_events(raw)
            texts = [json.loads(e)["choices"][0]["text"] for e in events if '"choices"' in e]
            assert texts == ["A", "B", "C"], raw
            assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "service_unavailable_error"
            assert len(events) == 5 and HALF not in raw, raw
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())


def _cut_is_safe_and_none_held(stream: bytes, pieces: list[bytes]) -> None:
    """Feed ``pieces`` to :class:`WholeEvents`: after each, what it relayed ends no mid-way through
    an event (an SSE reader's line and event both empty there), it holds no event the bytes fed
    have ended, and all of it relays ``stream`` byte for byte."""
    ended, safe = _event_ends(stream)
    events, relayed, fed = WholeEvents(), b"", 0
    for piece in pieces:
        relayed += events.take(piece)
        fed += len(piece)
        assert safe[len(relayed)], (stream, pieces, relayed)
        assert len(relayed) >= max((e for e in ended if e <= fed), default=0), (stream, pieces, relayed)
    assert relayed + events.rest() == stream


def _event_ends(stream: bytes) -> tuple[list[int], list[bool]]:
    """Where an SSE reader ends an event in ``stream`` (a CR, an LF, a CRLF: one line end each),
    and for each offset whether a cut there leaves it no partial line or event."""
    ended, safe = [], [True]
    in_line = in_event = after_cr = False
    for i, byte in enumerate(stream):
        if byte == 0x0A and after_cr:   # the LF of a CRLF: the CR ended the line
            after_cr = False
        elif byte in (0x0A, 0x0D):
            after_cr = byte == 0x0D
            if not in_line and in_event:
                ended.append(i + 1)
            in_event, in_line = in_line, False
        else:
            after_cr, in_line = False, True
        safe.append(not in_line and not in_event)
    return ended, safe


def test_whole_events_cuts_streams_of_any_line_ends_at_event_ends_only():
    """Streams of every mix of CR, LF and CRLF, split at random into reads: never relayed
    mid-event, never holding an event ended, never a byte changed. Before: an event ended by
    ``\\n\\r\\n`` stayed held."""
    rng = random.Random(34)
    words = [b"data: x", b"a", b"\n", b"\r", b"\r\n", b"\n"]
    for _ in range(3000):
        stream = b"".join(rng.choice(words) for _ in range(rng.randint(0, 24)))
        cuts = sorted(rng.sample(range(len(stream) + 1), min(len(stream) + 1, rng.randint(0, 8))))
        pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)]) if b > a]
        _cut_is_safe_and_none_held(stream, pieces)


# --- D2: a long event in many reads ------------------------------------------------------------
def test_a_long_event_in_many_reads_costs_its_length_not_its_square():
    """An event as long as the router holds, in 1,448-byte reads (TCP segments), then the next
    event. Before: each read re-joined and re-scanned all it held, ~0.6 s of event-loop time for
    one event (this thread's CPU time measured, not the clock's, so other processes do not count)."""
    event = b'data: {"choices": [{"text": "' + b"x" * (HELD_EVENT_BYTES - 100) + b'"}]}\n\n'
    pieces = [event[i:i + 1448] for i in range(0, len(event), 1448)] + [b"data: [DONE]\n\n"]
    stream = b"".join(pieces)
    events, relayed = WholeEvents(), []
    t0 = time.thread_time()
    for piece in pieces:
        relayed.append(events.take(piece))
    spent = time.thread_time() - t0
    assert b"".join(relayed) == stream and events.rest() == b""
    assert [len(r) for r in relayed if r] == [len(event), len(b"data: [DONE]\n\n")]   # each whole event at its end
    assert spent < 0.1, f"{len(pieces)} reads of one event cost {spent * 1e3:.0f} ms"


def test_a_long_event_in_many_reads_reaches_the_client_whole_through_the_router():
    """Control for the above through a real router: the long event and those around it arrive
    byte for byte, in every line end."""
    async def main():
        long = _token("x" * 200_000, b"\r\n\r\n")
        stream = _token("0", b"\n\r") + long + _token("1", b"\n\r\n") + b"data: [DONE]\n\n"
        w = Worker([stream[i:i + 1448] for i in range(0, len(stream), 1448)], end="done", gap_s=0)
        router, runner, url = await _serving(w)
        try:
            raw = b"".join(d for _, d in await _arrivals(url))
            assert raw == stream
            assert [e[:20] for e in _sse_events(raw)][-2:] == ['{"choices": [{"index', "[DONE]"]
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())


# --- D4: a scheme's default port ---------------------------------------------------------------
@pytest.mark.parametrize("one, other", [("https://llm.internal", "https://llm.internal:443"),
                                        ("http://127.0.0.1", "HTTP://127.0.0.1:80/"),
                                        ("http://[::1]:8000", "http://[::1]:08000")])
def test_a_worker_given_with_and_without_its_default_port_is_one_worker_given_twice(one, other):
    """Before: ``https://h`` and ``https://h:443``, one engine, were accepted as two workers
    (twice its share of requests; a drain of one name left the other serving)."""
    assert normal_url(one) == normal_url(other)
    with pytest.raises(ConfigError, match="given twice"):
        RouterConfig(workers=[WorkerSpec.parse(one), WorkerSpec.parse(other)]).check()


@pytest.mark.parametrize("one, other", [("http://bücher.example:8000", "http://xn--bcher-kva.example:8000"),
                                        ("http://[::1]:8000", "http://[0:0:0:0:0:0:0:1]:8000"),
                                        ("http://[FE80::1%eth0]:8000", "http://[fe80:0::1%eth0]:8000")])
def test_a_worker_written_in_another_text_form_of_its_host_is_one_worker_given_twice(one, other):
    """Before: an IDNA name and its punycode, or two text forms of one IPv6 address, which aiohttp
    connects to alike, were two workers (audit s34 r9 D1)."""
    assert normal_url(one) == normal_url(other)
    with pytest.raises(ConfigError, match="given twice"):
        RouterConfig(workers=[WorkerSpec.parse(one), WorkerSpec.parse(other)]).check()


@pytest.mark.parametrize("url, named", [("HTTPS://LLM.internal:443/", "https://llm.internal"),
                                        ("https://llm.internal:80", "https://llm.internal:80"),
                                        ("http://h:443", "http://h:443"),
                                        ("http://[FE80::1]:80", "http://[fe80::1]"),
                                        ("http://[::1]:8000/", "http://[::1]:8000")])
def test_a_worker_is_named_without_its_schemes_default_port_and_keeps_any_other(url, named):
    assert WorkerSpec.parse(url).url == named


def test_an_admin_add_of_a_worker_with_its_default_port_written_out_is_that_worker():
    """Over the admin API: ``http://127.0.0.1:80`` added to a router that has ``http://127.0.0.1``
    is the worker it has (200), never a second."""
    async def main():
        w = Worker([b"data: [DONE]\n\n"], end="done")
        await w.start()
        router, runner, url = await _router_of([w.url, "http://127.0.0.1"])
        try:
            async with ClientSession() as s:
                async with s.post(url + "/admin/workers", json={"url": "http://127.0.0.1:80/"}) as r:
                    assert r.status == 200, await r.text()
                    assert (await r.json())["url"] == "http://127.0.0.1"
            assert [x.url for x in router.workers] == [w.url, "http://127.0.0.1"]
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())


# --- D3: one worker, one name: the launcher and kvtier top ---------------------------------------
async def _router_of(worker_urls: list[str], **kw):
    """A real router on a free port in front of ``worker_urls`` as a user writes them."""
    config = RouterConfig(workers=[WorkerSpec.parse(u) for u in worker_urls], block_tokens=4,
                          kv_bytes_per_token=4096, health_interval_s=0.2, port=free_port(), **kw)
    router = Router(config, WordTokenizer())
    runner = router.runner()
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", config.port).start()
    return router, runner, f"http://127.0.0.1:{config.port}"


def test_the_launcher_drains_an_adopted_worker_spelt_as_the_user_gave_it(tmp_path):
    """A worker given as ``http://LocalHost:PORT/`` to both the router and ``plan live --adopt``,
    with a stream in flight. Before: the launcher never found that spelling among the router's
    (lower-cased) workers, so it read 0 in flight, did not wait, had its removal refused (409)
    and left the worker in the router, drained, for good."""
    async def main():
        slow = Worker([_token(str(i), b"\n\n") for i in range(12)] + [b"data: [DONE]\n\n"], end="done", gap_s=0.1)
        other = Worker([b"data: [DONE]\n\n"], end="done")
        for w in (slow, other):
            await w.start()
        spelt = f"http://LocalHost:{slow.port}/"
        router, runner, url = await _router_of([spelt, other.url], policy="round-robin")
        try:
            launcher = LocalLauncher(WorkerTemplate("tiny", kv_events=False), RouterAdmin(url), tmp_path,
                                     drain_timeout_s=30, poll_s=0.05, stop_timeout_s=5)
            adopted = launcher.adopt(spelt)
            router.workers[1].draining = True            # so that the stream goes to the adopted worker
            answer = asyncio.ensure_future(_arrivals(url))
            await until(lambda: router.workers[0].inflight == 1)
            router.workers[1].draining = False
            launcher.drain(adopted)
            await until(lambda: adopted.state == "stopped", 20)
            assert [w.url for w in router.workers] == [other.url]
            done = {a: t for t, a, n in launcher.actions if n == adopted.name}
            assert list(done) == ["drain", "removed", "stop"]
            # removed once its stream was over (~1.2 s), not at once with the stream in flight
            assert done["removed"] - done["drain"] > 0.6, done
            raw = b"".join(d for _, d in await answer)
            assert _sse_events(raw)[-1] == "[DONE]" and len(_sse_events(raw)) == 13
        finally:
            await runner.cleanup()
            for w in (slow, other):
                await w.stop()
    run(main())


def test_the_launcher_names_the_workers_it_starts_as_the_router_does(tmp_path):
    """The URL a started worker is registered under is the router's name for it, whatever the
    template's host spelling."""
    launcher = LocalLauncher(WorkerTemplate("tiny", kv_events=False, host="LocalHost",
                                            program=("/bin/sh", "-c", "sleep 30", "-")),
                             RouterAdmin("127.0.0.1:1"), tmp_path, health_timeout_s=1, stop_timeout_s=1,
                             poll_s=0.05)
    try:
        worker = launcher.start("prefill")
        assert worker.url == normal_url(worker.url) and worker.url.startswith("http://localhost:")
    finally:
        launcher.close(timeout_s=10)


def _metrics_worker() -> web.Application:
    app = web.Application()
    app.router.add_get("/health", lambda r: web.Response())
    app.router.add_get("/metrics", lambda r: web.Response(text="vllm:num_requests_running 0\n"))
    return app


@pytest.mark.parametrize("spelling", ["http://LocalHost:{port}", "LOCALHOST:{port}/"])
def test_kvtier_top_shows_a_worker_spelt_as_given_to_the_router_as_one_row(capsys, spelling):
    """Before: ``kvtier top --worker http://LocalHost:PORT`` beside a router given the same
    worker showed two rows, the router's figures under its lower-cased name and the worker's
    under the spelling given."""
    from kvtier.cli.main import main as kvtier

    async def main():
        port = free_port()
        worker = web.AppRunner(_metrics_worker())
        await worker.setup()
        await web.TCPSite(worker, "127.0.0.1", port).start()
        given = spelling.format(port=port)
        router, runner, url = await _router_of([given if "://" in given else f"http://{given}"])
        try:
            assert await asyncio.to_thread(kvtier, ["top", "--router", url, "--worker", given, "--once"]) == 0
        finally:
            await runner.cleanup()
            await worker.cleanup()
        return port

    port = run(main())
    rows = [line for line in capsys.readouterr().out.splitlines() if str(port) in line]
    assert len(rows) == 1, "\n".join(rows)
    assert f"http://localhost:{port}" in rows[0]
