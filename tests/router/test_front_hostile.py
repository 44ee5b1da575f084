"""The router's HTTP front against what a hostile or unusual client, browser or worker sends
(kvtier/router/app.py, abort.py, admin.py, relay.py), and KV events of several KV-cache groups
(events.py). Real sockets, stand-in workers as in test_http.py; no vLLM."""

from __future__ import annotations

import asyncio
import gc
import gzip
import json
import logging
import struct
import tracemalloc

import msgpack
import pytest
from aiohttp import ClientSession, web

from kvtier.router.abort import WorkerAborts
from kvtier.router.events import VllmEvents
from kvtier.router.index import BlockIndex, block_keys
from kvtier.router.workers import Worker
from tests.router.test_http import StandIn, one_worker_router, run, start_router

CHAT = {"messages": [{"role": "user", "content": "a b"}]}


# --- D1: a body request_id that is no header value ----------------------------------------------
@pytest.mark.parametrize("path,body,stream,own", [
    *[(path, body, stream, "job-1\r\nX-Evil: 1") for path, body in (("/v1/completions", {"prompt": "a b"}),
                                                                    ("/v1/chat/completions", CHAT))
      for stream in (False, True)],
    *[("/v1/completions", {"prompt": "a b"}, False, own) for own in ("job 1", "jöb", "x" * 300)]])
def test_a_body_request_id_that_is_no_header_value_is_no_header_not_a_500(path, body, stream, own):
    """The body's ``request_id`` (vLLM's field) was sent to the worker as the ``X-Request-Id``
    header as it was: with CR/LF aiohttp's client raised (header injection), a 500 and a logged
    traceback. It is sent as no header now (the worker reads it from the body, as vLLM does:
    test_openai_conformance.py), and the answer echoes it only as a short header-safe token
    (test_ids_batches_and_counts.py). Control: a safe one is echoed."""
    async def main():
        async with one_worker_router() as (w, router, url, s):
            async with s.post(url + path, json={**body, "stream": stream, "request_id": own}) as r:
                text = await r.text()
                assert r.status == 200, (r.status, text)
                # echoed only as a short header-safe token (abort.echoed_id): none of these is one
                assert r.headers.get("X-Request-Id") is None, r.headers
                assert "X-Evil" not in r.headers
            async with s.post(url + path, json={**body, "stream": stream, "request_id": "job-7"}) as r:
                await r.read()
                assert r.status == 200 and r.headers["X-Request-Id"] == "job-7"   # control
            assert router.metrics.errors.labels("internal")._value.get() == 0
    run(main())


def test_a_request_aiohttp_cannot_send_is_the_clients_400(monkeypatch):
    """The second safeguard: whatever makes aiohttp's client refuse the request (a ValueError) is
    answered 400, not a 500, and charges the worker no failure (no retry, still healthy)."""
    import kvtier.router.app as app

    monkeypatch.setattr(app, "request_id", lambda path, headers, body: ("bad\r\nid", True))

    async def main():
        async with one_worker_router() as (w, router, url, s):
            async with s.post(url + "/v1/completions", json={"prompt": "a b"}) as r:
                answer = await r.json()
                assert r.status == 400 and answer["error"]["type"] == "invalid_request_error", answer
            assert router.metrics.errors.labels("internal")._value.get() == 0
            assert router.metrics.retries._value.get() == 0 and router.workers[0].healthy and w.requests == 0
    run(main())


# --- D2: a batch's engine ids, built only for an abort ------------------------------------------
def test_a_batch_of_many_empty_prompts_costs_memory_in_proportion_to_its_body():
    """One ``cmpl-<32 hex>-<i>`` string per prompt was built for every completion batch (~100
    bytes of Python for 3 bytes of JSON, ``""``), though only an abort uses them: a 64 MiB body
    was ~2 GB. Here 1 M prompts (3 MB) must cost under 20x the body (it was 116 MB traced)."""
    raw = b'{"max_tokens": 1, "prompt": [' + b",".join([b'""'] * 1_000_000) + b"]}"

    async def main():
        async with one_worker_router() as (w, router, url, s):
            gc.collect()
            tracemalloc.start()
            try:
                async with s.post(url + "/v1/completions", data=raw, headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            # control: forwarded (the stand-in answers its own 413: aiohttp's 1 MiB body limit)
            assert r.headers.get("X-Kvtier-Worker") == w.url, r.status
            assert peak < 20 * len(raw), f"peak {peak / 1e6:.0f} MB traced for a {len(raw) / 1e6:.1f} MB body"
    run(main())


def test_engine_ids_are_built_only_for_an_abort_and_a_huge_batch_is_not_named():
    """A batch's ids are a count until an abort builds them, and an abort names at most
    MAX_ABORT_IDS (a larger batch is left to its closed connection, counted ``too_many``).
    Control: a batch within the bound is aborted by every id, as vLLM names them."""
    from kvtier.router.abort import MAX_ABORT_IDS, engine_request_ids, engine_requests
    huge = engine_requests("/v1/completions", "r", {"prompt": [""] * 10_000_000})
    assert huge.count == 10_000_000
    assert engine_requests("/v1/chat/completions", "r", {}).ids() == ["chatcmpl-r"]
    assert engine_requests("/v1/responses", "r", {}) is None
    # (built, for tools and tests: tests/integrations/vllm/test_router.py)
    assert engine_request_ids("/v1/completions", "r", {"prompt": ["a", "b"]}) == ["cmpl-r-0", "cmpl-r-1"]

    class Session:   # records the posts an abort makes
        closed = False
        posts: list = []

        def post(self, url, data, headers, timeout):   # (the abort's JSON body, encoded)
            self.posts.append(json.loads(data)["request_ids"])
            return _Answer()

    class _Answer:
        status = 200

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return False

    async def main():
        results: list[str] = []
        aborts = WorkerAborts(lambda url, result: results.append(result))
        session = Session()
        aborts.send(session, "http://w", huge, None)
        within = engine_requests("/v1/completions", "r", {"prompt": ["a"] * MAX_ABORT_IDS})
        aborts.send(session, "http://w", within, None)
        await aborts.drain()
        assert results == ["too_many", "ok"]
        assert session.posts == [[f"cmpl-r-{i}" for i in range(MAX_ABORT_IDS)]]   # control
    asyncio.run(main())


# --- D3: the token-less admin API and a browser on the router's host ------------------------------
@pytest.mark.parametrize("how,headers,status", [
    ("cross_site_form", {"Content-Type": "text/plain;charset=UTF-8", "Origin": "http://evil.example"}, 403),
    ("blob_body_no_origin", {"Content-Type": "text/plain"}, 415),
    ("json_with_origin", {"Content-Type": "application/json", "Origin": "http://evil.example"}, 403),
    ("dns_rebinding", {"Content-Type": "application/json", "Host": "rebind.evil.example:{port}"}, 403),
])
def test_the_loopback_admin_api_refuses_what_a_browser_page_can_send(how, headers, status):
    """Without KVTIER_ROUTER_ADMIN_TOKEN any loopback peer was trusted, whatever the body's type:
    a page in a browser on the router's host could add a worker of its choosing (a ``text/plain``
    post needs no CORS preflight; DNS rebinding names the page's own host), and every user's
    prompts and keys went there. Control: the same body as a local tool sends it, under each
    loopback name, is served."""
    async def main():
        async with one_worker_router() as (w, router, url, s):
            port = url.rsplit(":", 1)[1]
            sent = {k: v.format(port=port) for k, v in headers.items()}
            body = json.dumps({"url": "http://203.0.113.9:80"})
            async with s.post(url + "/admin/workers", data=body, headers=sent) as r:
                answer = await r.json()
                assert r.status == status and answer["error"]["type"] == "admin_error", (r.status, answer)
            if how == "dns_rebinding":   # reading the worker list is refused too
                async with s.get(url + "/admin/workers", headers={"Host": sent["Host"]}) as r:
                    assert r.status == 403
            assert [x.url for x in router.workers] == [w.url], "a web page added a worker"
            for i, host in enumerate([f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"]):   # control
                async with s.post(url + "/admin/workers", json={"url": f"http://127.0.0.1:{20 + i}"},
                                  headers={"Host": host}) as r:
                    assert r.status == 201, (host, await r.text())
            assert len(router.workers) == 4
    run(main())


def test_host_names_are_read_without_their_port():
    from kvtier.router.admin import _host_name
    assert [_host_name(h) for h in ("127.0.0.1:8000", "[::1]:80", "[::1]", "LocalHost:1", "localhost", "::1",
                                    "evil.example:80", "127.0.0.1.evil.example")] == \
        ["127.0.0.1", "::1", "::1", "localhost", "localhost", "::1", "evil.example", "127.0.0.1.evil.example"]


# --- D4 / D5: what a worker is sent, and a compressed answer --------------------------------------
class Echo(StandIn):
    """/v1/embeddings answers the headers it received."""

    async def other(self, request):
        await request.read()
        return web.json_response({"headers": {k.lower(): v for k, v in request.headers.items()}})


def test_hop_by_hop_headers_and_proxy_credentials_are_not_forwarded():
    """Only host, content-length, transfer-encoding, connection and keep-alive were dropped:
    Proxy-Authorization (the client's credentials for a proxy in front of the router), TE,
    Upgrade, Proxy-Connection and the headers the client's Connection header names reached the
    worker (RFC 9110 §7.6.1: a proxy drops them). The worker is asked for no compression.
    Control: end-to-end headers (the client's key, its own ones) still reach it."""
    async def main():
        w = Echo("w0")
        await w.start()
        router, runner, url = await start_router([w])
        try:
            async with ClientSession() as s:
                async with s.post(url + "/v1/embeddings", data=b'{"input": "a"}', headers={
                        "Content-Type": "application/json", "Connection": "keep-alive, X-Hop-Secret",
                        "X-Hop-Secret": "s3", "Proxy-Authorization": "Basic cHJveHk6cGFzcw==",
                        "Proxy-Connection": "keep-alive", "TE": "trailers", "Upgrade": "websocket",
                        "Accept-Encoding": "gzip, br", "Authorization": "Bearer k1", "X-Tenant": "t1"}) as r:
                    got = (await r.json())["headers"]
            leaked = set(got) & {"x-hop-secret", "proxy-authorization", "proxy-connection", "te", "upgrade"}
            assert not leaked, f"forwarded to the worker: {sorted(leaked)}"
            assert got["accept-encoding"] == "identity"
            assert got["authorization"] == "Bearer k1" and got["x-tenant"] == "t1"      # control
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())


def test_forwarded_headers_drop_every_connection_option():
    from kvtier.router.relay import forwarded_headers
    sent = forwarded_headers({"Connection": "Upgrade, X-A", "connection": "x-b", "X-A": "1", "X-B": "2",
                              "accept-encoding": "gzip", "X-C": "3", "Trailer": "X-D", "Proxy-Authenticate": "x"})
    assert sent == {"X-C": "3", "Accept-Encoding": "identity"}


class Compressing(StandIn):
    """A worker (or the ingress before it) that compresses when the request accepts it."""

    ANSWER = {"object": "list", "data": [{"embedding": [0.5] * 512}], "usage": {"prompt_tokens": 1}}

    async def other(self, request):
        await request.read()
        resp = web.json_response(self.ANSWER)
        resp.enable_compression()   # honours the request's Accept-Encoding
        return resp


class AlwaysGzip(StandIn):
    """An ingress that gzips whatever the request accepts."""

    async def complete(self, request):
        await request.read()
        usage = {"prompt_tokens": 8, "prompt_tokens_details": {"cached_tokens": 4}}
        return web.Response(body=gzip.compress(json.dumps({"object": "text_completion", "usage": usage}).encode()),
                            headers={"Content-Encoding": "gzip"}, content_type="application/json")


def test_a_compressing_worker_answer_reaches_the_client_decodable():
    """The router let aiohttp ask the worker for ``gzip, deflate`` whatever the client accepted, did
    not decompress, and relayed only Content-Type: gzip bytes labelled as plain JSON. Now it asks
    for ``identity``. Control: the worker does compress for a caller that accepts it."""
    async def main():
        w = Compressing("w0")
        await w.start()
        router, runner, url = await start_router([w])
        try:
            async with ClientSession(auto_decompress=False, skip_auto_headers=["Accept-Encoding"]) as s:
                async with s.post(w.url + "/v1/embeddings", json={"input": "a"},
                                  headers={"Accept-Encoding": "gzip"}) as r:
                    assert r.headers.get("Content-Encoding") == "gzip"                     # control
                async with s.post(url + "/v1/embeddings", json={"input": "a"}) as r:
                    raw = await r.read()
                    encoding = r.headers.get("Content-Encoding")
            assert encoding is None and json.loads(raw) == Compressing.ANSWER, (encoding, raw[:12])
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())


def test_a_worker_that_compresses_unasked_has_its_encoding_passed_on():
    """An ingress that compresses all the same: the client is told (Content-Encoding passed on)
    and decodes the answer; the router reads no usage from the compressed bytes."""
    async def main():
        w = AlwaysGzip("w0")
        await w.start()
        router, runner, url = await start_router([w])
        try:
            async with ClientSession() as s:   # (decompresses what it is told is compressed)
                async with s.post(url + "/v1/completions", json={"prompt": "a b"}) as r:
                    assert r.status == 200 and r.headers.get("Content-Encoding") == "gzip"
                    assert (await r.json())["usage"]["prompt_tokens"] == 8
            assert router.metrics.actual_cached.labels(w.url)._value.get() == 0
            assert router.metrics.errors.labels("internal")._value.get() == 0
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())


# --- D6: a large whole answer, relayed without being held ------------------------------------------
class LargeAnswer(StandIn):
    """/v1/embeddings streams a ~32 MB JSON answer in 256 KiB writes, its usage last (vLLM's order)."""

    ROW = b'{"index": 0, "embedding": [' + b"0.1234567890123," * 2000 + b'0.5]},'
    USAGE = {"prompt_tokens": 9, "total_tokens": 9, "prompt_tokens_details": {"cached_tokens": 7}}

    async def other(self, request):
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        await resp.write(b'{"object": "list", "data": [')
        rows = self.ROW * (262144 // len(self.ROW))
        for _ in range(32 * 1024 * 1024 // len(rows)):
            await resp.write(rows)
        await resp.write(self.ROW[:-1] + b'], "usage": ' + json.dumps(self.USAGE).encode() + b"}")
        return resp


def test_a_large_whole_answer_is_relayed_without_being_held_whole():
    """A non-streamed answer was kept whole (the tail cap was for streams only) and parsed on the
    event loop for its usage: a 97 MB embeddings answer stalled every stream for 0.76 s. Now a
    whole answer over 1 MiB keeps a bounded tail and its usage is read from there. Control: the
    usage at its end is still counted."""
    async def main():
        w = LargeAnswer("w0")
        await w.start()
        router, runner, url = await start_router([w])
        try:
            async with ClientSession() as s:
                gc.collect()
                tracemalloc.start()
                try:
                    async with s.post(url + "/v1/embeddings", json={"input": "a"}) as r:
                        n = 0
                        async for chunk in r.content.iter_any():
                            n += len(chunk)
                    _, peak = tracemalloc.get_traced_memory()
                finally:
                    tracemalloc.stop()
            assert n > 32e6 and peak < 12e6, f"peak {peak / 1e6:.0f} MB traced relaying {n / 1e6:.0f} MB"
            assert router.metrics.actual_cached.labels(w.url)._value.get() == 7          # control
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())


def test_what_is_kept_of_an_answer_is_bounded_and_still_has_its_usage():
    from kvtier.router.relay import TAIL_BYTES, WHOLE_PARSE_BYTES, KeptAnswer
    usage = {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 3}}
    body = b'{"id": "resp_1", "data": "' + b"x" * (3 * WHOLE_PARSE_BYTES) + b'", "usage": ' + \
        json.dumps(usage).encode() + b"}"
    kept = KeptAnswer(body[:1000], streaming=False, keep_head=True)
    for i in range(1000, len(body), 70_000):
        kept.add(body[i:i + 70_000])
    assert kept.whole is None and len(kept.tail) == TAIL_BYTES and kept.head.startswith(b'{"id": "resp_1"')
    assert kept.usage() == usage
    small = b'{"usage": {"prompt_tokens": 2}, "data": "' + b"y" * 100_000 + b'"}'   # usage first: parsed whole
    kept = KeptAnswer(small[:10], streaming=False, keep_head=False)
    kept.add(small[10:])
    assert kept.usage() == {"prompt_tokens": 2} and kept.head is None


# --- D7: KV events of several KV-cache groups ---------------------------------------------------
BS = 4
TOKENS = list(range(100, 100 + 3 * BS))


def _message(seq, events):
    return [b"", struct.pack(">Q", seq), msgpack.packb([1.0, events, None])]


def _stored(hashes, group, kind, encoding, size=BS, tokens=TOKENS):
    """A BlockStored as vLLM's msgspec encoder writes it (a map tagged ``type``; vllm/distributed/
    kv_events.py), or in the array-like encoding events.py also reads."""
    fields = {"block_hashes": hashes, "parent_block_hash": None, "token_ids": tokens, "block_size": size,
              "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": None, "group_idx": group,
              "kv_cache_spec_kind": kind}
    return {"type": "BlockStored", **fields} if encoding == "map" else ["BlockStored", *fields.values()]


def _removed(hashes, group, encoding):
    fields = {"block_hashes": hashes, "medium": "GPU", "group_idx": group}
    return {"type": "BlockRemoved", **fields} if encoding == "map" else ["BlockRemoved", *fields.values()]


def _listener(ignored: list | None = None):
    index = BlockIndex(BS)
    on_ignored = (lambda w, reason, n: ignored.append((reason, n))) if ignored is not None else None
    return index, VllmEvents(Worker(0, "http://w0"), index, on_ignored=on_ignored)


@pytest.mark.parametrize("encoding", ["map", "array"])
@pytest.mark.parametrize("full", [0, 1])
def test_a_removal_in_one_kv_cache_group_keeps_the_blocks_another_group_holds(encoding, full):
    """vLLM publishes each block once per KV-cache group; a hybrid model's sliding-window group
    evicts blocks outside its window that its full-attention group still holds and serves. Its
    BlockRemoved uncredited them. Only the first full-attention group is indexed, whichever its
    index. Control: a removal in that group does clear them."""
    window = 1 - full
    kind = {full: "full_attention", window: "sliding_window"}
    index, events = _listener()
    events.handle(_message(0, [_stored([11, 12, 13], 0, kind[0], encoding),
                               _stored([11, 12, 13], 1, kind[1], encoding)]))
    keys = block_keys(TOKENS, BS)
    assert len(index.masks(keys)) == 3
    events.handle(_message(1, [_removed([11, 12], window, encoding)]))   # the window's old blocks
    assert len(index.masks(keys)) == 3, "the sliding window's removal uncredited blocks the full group holds"
    events.handle(_message(2, [_removed([12, 13], full, encoding)]))     # control
    assert len(index.masks(keys)) == 1 and events.group == full


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_events_without_groups_are_indexed_as_before(encoding):
    """A vLLM that names no group (fields absent, or None): its one group is indexed."""
    index, events = _listener()
    plain = _stored([11, 12, 13], None, None, encoding)
    if encoding == "map":
        plain = {k: v for k, v in plain.items() if k not in ("group_idx", "kv_cache_spec_kind")}
    events.handle(_message(0, [plain]))
    assert len(index.masks(block_keys(TOKENS, BS))) == 3
    events.handle(_message(1, [_removed([13], None, encoding)]))
    assert len(index.masks(block_keys(TOKENS, BS))) == 2


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_a_group_of_another_block_size_is_an_ignored_group_not_a_block_tokens_error(encoding, caplog):
    """A Mamba hybrid publishes its state group (group 0, first) in blocks of another size: the
    router said to change --block-tokens, which is wrong advice (its attention group matches).
    It is reported as an ignored group, and the attention group is indexed. Control: a
    full-attention group of another size is still the --block-tokens error."""
    ignored: list = []
    index, events = _listener(ignored)
    with caplog.at_level(logging.INFO, logger="kvtier.router.events"):
        events.handle(_message(0, [_stored([1], 0, "mamba", encoding, size=8 * BS, tokens=[5] * 8 * BS),
                                   _stored([11, 12, 13], 1, "full_attention", encoding)]))
    assert len(index.masks(block_keys(TOKENS, BS))) == 3 and ignored == [("kv_cache_group", 1)]
    assert not [r for r in caplog.records if "--block-tokens" in r.getMessage() and r.levelno >= logging.ERROR]
    _, other = _listener(ignored)
    with caplog.at_level(logging.INFO, logger="kvtier.router.events"):
        other.handle(_message(0, [_stored([1], 0, "full_attention", encoding, size=2 * BS, tokens=[5] * 2 * BS)]))
    assert ignored[-1] == ("block_size", 1)                                     # control
    assert [r for r in caplog.records if "--block-tokens 8" in r.getMessage() and r.levelno == logging.ERROR]
