"""What one client can make the router hold at its front door (audit s28, DOS-2 and DOS-3):
connections that send no request, connections per address, request bodies in flight (counted as
they arrive, one address's still arriving bounded: R1); a kept-alive connection is not held to the
first head's deadline (R3)."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import select
import socket
import subprocess
import sys
import time
import tracemalloc
import urllib.request
from pathlib import Path

import pytest
from aiohttp import ClientSession, web

from kvtier.errors import ConfigError
from kvtier.router.config import RouterConfig, WorkerSpec
from tests.router.test_http import StandIn, one_worker_router, run, start_router, until

HERE = Path(__file__).resolve().parent


async def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the router closed ``sock`` (EOF, a reset, or a 4xx answer) within ``seconds``."""
    sock.setblocking(False)
    try:
        data = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(sock, 1024), seconds)
        return data == b"" or data.startswith(b"HTTP/1.1 4")
    except asyncio.TimeoutError:
        return False
    except ConnectionError:
        return True


def test_a_connection_without_a_whole_request_head_is_closed_after_the_header_timeout():
    """DOS-2: a connection that sent nothing, or half a request head, was kept until aiohttp's
    keep-alive timer: about an hour through ``Router.runner()`` (75 s under ``kvtier route``),
    and ``body_timeout_s`` starts only once the head is in. Now ``header_timeout_s``."""
    async def main():
        async with one_worker_router(header_timeout_s=1.0) as (w, router, url, s):
            port = int(url.rsplit(":", 1)[1])
            silent = socket.create_connection(("127.0.0.1", port))
            half = socket.create_connection(("127.0.0.1", port))
            half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")   # and never the rest
            t0 = time.monotonic()
            closed = {name: await closed_within(sock, max(0.1, 3.0 - (time.monotonic() - t0)))
                      for name, sock in (("silent", silent), ("half", half))}
            silent.close()
            half.close()
            assert closed == {"silent": True, "half": True}, f"still open 3 s after connecting: {closed}"
            async with s.post(url + "/v1/completions", json={"prompt": "a b c d"}) as r:   # control
                assert r.status == 200
    run(main())


def test_one_address_holds_its_share_of_connections_its_idle_ones_going_first():
    """Past ``max_connections_per_peer``, the address's connection idle longest is closed; with
    every one of them answering a request, the newcomer is closed and the requests go on."""
    async def main():
        async with one_worker_router(max_connections_per_peer=2) as (w, router, url, s):
            port = int(url.rsplit(":", 1)[1])
            first, second = (socket.create_connection(("127.0.0.1", port)) for _ in range(2))
            await until(lambda: router.peers.connections("127.0.0.1") == 2)
            third = socket.create_connection(("127.0.0.1", port))
            assert await closed_within(first, 1.0), "the idle-longest connection was kept"
            assert not await closed_within(third, 0.2)
            for sock in (second, third):
                sock.close()
            await until(lambda: router.peers.connections("127.0.0.1") == 0)

            async def stream():   # each on a connection of its own (the stand-in streams 0.6 s)
                async with ClientSession() as own:
                    async with own.post(url + "/v1/completions", json={"prompt": "a b", "stream": True}) as r:
                        await r.read()
                        return r.status
            busy = [asyncio.ensure_future(stream()) for _ in range(2)]
            await until(lambda: w.requests == 2)
            newcomer = socket.create_connection(("127.0.0.1", port))
            assert await closed_within(newcomer, 1.0), "a third connection was kept beside two busy ones"
            newcomer.close()
            assert await asyncio.gather(*busy) == [200, 200]
    run(main())


def test_a_cap_of_one_connection_per_address_still_serves_it():
    """The edge of the bookkeeping: each new connection replaces the address's only one."""
    async def main():
        async with one_worker_router(max_connections_per_peer=1) as (w, router, url, s):
            port = int(url.rsplit(":", 1)[1])
            silent = socket.create_connection(("127.0.0.1", port))
            await until(lambda: router.peers.connections("127.0.0.1") == 1)
            for _ in range(2):
                async with s.post(url + "/v1/completions", json={"prompt": "a b c d"}) as r:
                    assert r.status == 200
            assert await closed_within(silent, 1.0)
            silent.close()
            await s.close()
            await until(lambda: router.peers.connections("127.0.0.1") == 0)
    run(main())


def test_one_peers_silent_connections_do_not_lock_others_out_of_the_router():
    """DOS-2: one peer (127.0.0.2) that opened more silent sockets than the router had descriptors
    (soft RLIMIT_NOFILE 256 here) ran its accept loop out of them (EMFILE): 3 of 3 requests from
    another address timed out. Default settings: a quarter of the limit per address."""
    soft = 256
    child = subprocess.Popen([sys.executable, str(HERE / "_front_door_child.py"), str(soft)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONWARNINGS": "ignore"})
    hog: list[socket.socket] = []
    try:
        url = child.stdout.readline().strip()
        assert url.startswith("http://"), url
        port = int(url.rsplit(":", 1)[1])

        def ask() -> int | str:
            req = urllib.request.Request(url + "/v1/completions", data=b'{"prompt": "a b c d"}',
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=5) as r:
                    return r.status
            except Exception as exc:  # noqa: BLE001
                return type(exc).__name__

        assert ask() == 200, "control: served with no flood"
        for _ in range(soft + 50):
            s = socket.socket()
            s.bind(("127.0.0.2", 0))
            s.connect(("127.0.0.1", port))
            hog.append(s)
        time.sleep(1.0)
        got = [ask() for _ in range(3)]
        assert got == [200] * 3, f"another client's requests while one peer holds {len(hog)} silent sockets: {got}"
    finally:
        for s in hog:
            s.close()
        child.stdin.close()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


class HeldWorker(StandIn):
    """Answers its completions only once ``release`` is set: they stay in flight in the router."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.release = asyncio.Event()

    async def complete(self, request):
        await request.content.read()          # (past aiohttp's 1 MiB client_max_size)
        self.requests += 1
        await self.release.wait()
        return web.json_response({"id": "x", "choices": [{"text": "a"}],
                                  "usage": {"prompt_tokens": 4, "completion_tokens": 1}})


def test_requests_in_flight_do_not_hold_their_parsed_bodies():
    """DOS-3: each request kept its parsed JSON until its answer ended: a field the router never
    reads, ``[{}, {}, …]``, is ~25x its bytes in Python. 4 requests of 4 MiB in flight held
    424 MB traced; the limit is 4 bytes per body byte (the raw body forwarded, the worker's copy)."""
    raw = b'{"prompt": "a b c d", "max_tokens": 1, "x": [' + b",".join([b"{}"] * ((4 << 20) // 3)) + b"]}"

    async def main():
        w = HeldWorker("w0")
        await w.start()
        router, runner, url = await start_router([w])
        try:
            async with ClientSession() as s:
                async def one():
                    async with s.post(url + "/v1/completions", data=raw,
                                      headers={"Content-Type": "application/json"}) as r:
                        await r.read()
                        return r.status
                gc.collect()
                tracemalloc.start()
                try:
                    tasks = [asyncio.ensure_future(one()) for _ in range(4)]
                    await until(lambda: w.requests == 4, 60.0)   # each parsed, routed and forwarded
                    assert w.requests == 4
                    gc.collect()
                    held, _ = tracemalloc.get_traced_memory()
                finally:
                    tracemalloc.stop()
                    w.release.set()
                assert await asyncio.gather(*tasks) == [200] * 4
                limit = 4 * 4 * len(raw)
                assert held < limit, (f"{held / 1e6:.0f} MB held by 4 requests in flight of {len(raw) / 1e6:.1f} MB "
                                      f"each (limit {limit / 1e6:.0f} MB)")
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())


def test_bodies_in_flight_are_bounded_in_bytes():
    """DOS-3: nothing bounded the bodies held by requests in flight (each kept until its answer
    ends). Past ``max_inflight_body_bytes``, 429 before the body is read; given back at the end."""
    body = b'{"prompt": "a b c d", "pad": "' + b"x" * 4000 + b'"}'

    async def main():
        w = HeldWorker("w0")
        await w.start()
        router, runner, url = await start_router([w], max_body_bytes=len(body), max_form_body_bytes=len(body),
                                                 max_inflight_body_bytes=2 * len(body))
        try:
            async with ClientSession() as s:
                async def one():
                    async with s.post(url + "/v1/completions", data=body,
                                      headers={"Content-Type": "application/json"}) as r:
                        return r.status, (await r.json()).get("error", {}).get("type")
                held = [asyncio.ensure_future(one()) for _ in range(2)]
                await until(lambda: w.requests == 2)
                third = asyncio.ensure_future(one())
                try:
                    await asyncio.wait([third], timeout=5.0)
                    assert third.done() and third.result() == (429, "rate_limit_error"), \
                        f"a third body past max_inflight_body_bytes was taken: {w.requests} at the worker"
                    assert router.bodies.held == 2 * len(body)
                finally:
                    w.release.set()
                    await asyncio.gather(third, return_exceptions=True)
                assert await asyncio.gather(*held) == [(200, None)] * 2
                assert router.bodies.held == 0
                assert await one() == (200, None)   # taken again once the others ended
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())


def _declare_body(port: int, head: bytes, sent: bytes, source: str = "127.0.0.1") -> socket.socket:
    """A connection from ``source`` that sends ``head`` and the first bytes of its body, ``sent``,
    and then nothing (well within ``body_timeout_s``)."""
    sock = socket.socket()
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    sock.sendall(head + sent)
    return sock


async def _first_bytes(sock: socket.socket, seconds: float = 5.0) -> bytes:
    """What the router sends first on ``sock`` (read on the test's loop, which is the router's)."""
    sock.setblocking(False)
    return await asyncio.wait_for(asyncio.get_running_loop().sock_recv(sock, 4096), seconds)


def _post_head(length: int | None) -> bytes:
    framing = b"Transfer-Encoding: chunked" if length is None else b"Content-Length: %d" % length
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + framing
            + b"\r\n\r\n")


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_bodies_declared_but_not_sent_do_not_lock_other_clients_out(framing):
    """Audit s28 R1: the budget charged what a head *declared* (its Content-Length, or
    ``max_body_bytes`` for a chunked body) before a byte arrived. 64 sockets that each declared
    16 MiB (the default ``max_body_bytes``) and sent one byte held the whole default 1 GiB, and
    every other client was answered 429 for ``body_timeout_s``. Now a body counts what arrived."""
    head, sent = (_post_head(16 << 20), b"{") if framing == "content-length" else (_post_head(None), b"1\r\n{")

    async def main():
        async with one_worker_router() as (w, router, url, s):
            port = int(url.rsplit(":", 1)[1])
            hog = [_declare_body(port, head, sent) for _ in range(64)]
            try:
                await until(lambda: router.bodies.held >= 64)
                async with s.post(url + "/v1/completions", json={"prompt": "a b c d"}) as r:
                    assert r.status == 200, f"another client was refused: {r.status} {(await r.text())[:160]}"
                assert router.bodies.held == 64, f"64 sockets that sent 1 body byte each hold {router.bodies.held}"
            finally:
                for sock in hog:
                    sock.close()
            await until(lambda: router.bodies.held == 0)
            assert router.bodies.held == 0 and router.bodies.arriving("127.0.0.1") == 0
    run(main())


def test_one_address_holds_at_most_its_share_of_bodies_still_arriving():
    """Audit s28 R1, the rest: sending most of many bodies and stalling is the cheapest way left to
    hold the budget, so one address's bodies still arriving count at most
    ``max_arriving_body_bytes_per_peer``. Its body whose next piece would pass that is answered
    429 and closed; another address is served, and bodies wholly in do not count."""
    async def main():
        async with one_worker_router(max_body_bytes=1000, max_form_body_bytes=1000,
                                     max_arriving_body_bytes_per_peer=2000) as (w, router, url, s):
            port = int(url.rsplit(":", 1)[1])
            hog = []
            try:
                for n in range(1, 4):
                    hog.append(_declare_body(port, _post_head(1000), b"{" + b" " * 599, source="127.0.0.2"))
                    await until(lambda: router.bodies.arriving("127.0.0.2") == 600 * n)
                assert router.bodies.arriving("127.0.0.2") == 1800
                fourth = _declare_body(port, _post_head(1000), b"{" + b" " * 599, source="127.0.0.2")
                hog.append(fourth)
                answer = await _first_bytes(fourth)
                assert answer.startswith(b"HTTP/1.1 429") and b"max_arriving_body_bytes_per_peer" in answer, answer[:300]
                assert router.bodies.arriving("127.0.0.2") == 1800
                async with s.post(url + "/v1/completions", json={"prompt": "a b c d"}) as r:   # another address
                    assert r.status == 200
                assert router.bodies.arriving("127.0.0.1") == 0, "a body wholly in still counts as arriving"
            finally:
                for sock in hog:
                    sock.close()
            await until(lambda: router.bodies.held == 0)
            assert router.bodies.held == 0 and router.bodies.arriving("127.0.0.2") == 0
    run(main())


def test_a_kept_alive_connection_reused_after_the_header_timeout_still_gets_an_answer():
    """Audit s28 R3: ``header_timeout_s`` was aiohttp's keep-alive timer, so it also closed a
    kept-alive connection idle *between* requests (5 s; 75 s under ``run_app`` before). aiohttp's
    client pools connections 15 s, reuses one without looking at it and does not retry a POST:
    a client busy past the header timeout then failed its next POST (ClientOSError). The head
    deadline now covers a new connection's first head; idle ones have ``keepalive_timeout_s``."""
    async def main():
        async with one_worker_router(header_timeout_s=1.0) as (w, router, url, s):
            async with ClientSession() as client:
                async with client.post(url + "/v1/completions", json={"prompt": "a b c d"}) as r:
                    assert r.status == 200
                    await r.read()
                time.sleep(1.5)   # the client's loop busy (a blocking call) past the header timeout
                try:
                    async with client.post(url + "/v1/completions", json={"prompt": "a b c d"}) as r:
                        got = r.status
                except Exception as exc:  # noqa: BLE001
                    got = type(exc).__name__
                assert got == 200, f"a POST on a kept-alive connection idle 1.5 s: {got}"
                assert router.peers.connections("127.0.0.1") == 1, "the pooled connection was not the one reused"
    run(main())


def test_a_kept_alive_connection_idle_past_the_keepalive_timeout_is_closed():
    """The other half of R3's split: idle between requests, a connection is closed after
    ``keepalive_timeout_s`` (here shorter than the head deadline, to tell the two apart)."""
    async def main():
        async with one_worker_router(header_timeout_s=5.0, keepalive_timeout_s=0.5) as (w, router, url, s):
            port = int(url.rsplit(":", 1)[1])
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await _first_bytes(sock)).startswith(b"HTTP/1.1 200")
            t0 = time.monotonic()
            assert await closed_within(sock, 3.0), "an idle kept-alive connection was kept past keepalive_timeout_s"
            assert time.monotonic() - t0 < 2.0
            sock.close()
            await until(lambda: router.peers.connections("127.0.0.1") == 0)
    run(main())


def test_an_answer_being_written_reaches_a_connection_closed_for_a_newcomer():
    """Audit s28 suspicion: a connection counts as idle once its handler returns, before aiohttp
    writes the ``web.Response`` it returned, so a newcomer at the address's cap closes it. Its
    answer still arrives whole: aiohttp hands the transport the whole body in one write, and a
    closed transport sends what it was given before it closes. Pinned here (a listing of ~800 KB
    to a reader with a 4 KiB receive buffer, at ``max_connections_per_peer = 1``)."""
    async def main():
        async with one_worker_router(max_connections_per_peer=1, models_refresh_s=0) as (w, router, url, s):
            w.loras = [f"adapter-{i:06d}-" + "x" * 40 for i in range(5000)]
            port = int(url.rsplit(":", 1)[1])
            loop = asyncio.get_running_loop()
            slow = socket.socket()
            slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            slow.connect(("127.0.0.1", port))
            slow.setblocking(False)
            slow.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            await until(lambda: select.select([slow], [], [], 0)[0])   # its answer is being written
            before = set(router.peers._peer)
            newcomer = socket.create_connection(("127.0.0.1", port))
            await until(lambda: router.peers._peer and not before & set(router.peers._peer))
            assert not before & set(router.peers._peer), "the connection being answered was not the one closed"
            data = b""
            while chunk := await asyncio.wait_for(loop.sock_recv(slow, 1 << 16), 5.0):
                data += chunk
            slow.close()
            newcomer.close()
            head, _, body = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200") and len(json.loads(body)["data"]) == 5001, len(body)
    run(main())


def test_the_front_door_settings_are_checked_at_start():
    """``keepalive_timeout_s`` > 0; ``max_arriving_body_bytes_per_peer`` a size, 0 for an eighth of
    the bodies in flight (never under one body), and at least ``max_body_bytes`` when set."""
    def config(**kw):
        return RouterConfig(workers=[WorkerSpec("http://127.0.0.1:1")], **kw).check()

    assert config().arriving_body_bytes_per_peer() == 128 << 20
    assert config(max_arriving_body_bytes_per_peer="256MiB").arriving_body_bytes_per_peer() == 256 << 20
    assert config(max_body_bytes=1000, max_form_body_bytes=1000,
                  max_inflight_body_bytes=2000).arriving_body_bytes_per_peer() == 1000
    for bad in ({"keepalive_timeout_s": 0}, {"keepalive_timeout_s": float("nan")},
                {"max_arriving_body_bytes_per_peer": -1},
                {"max_body_bytes": 1000, "max_form_body_bytes": 1000, "max_arriving_body_bytes_per_peer": 999}):
        with pytest.raises(ConfigError):
            config(**bad)
