"""vLLM's speech-to-text endpoints take a multipart form whose audio file may be up to 25 MiB
(``VLLM_MAX_AUDIO_CLIP_FILESIZE_MB``, OpenAI's limit too). The router takes such a form up to
``max_form_body_bytes`` (32 MiB by default: the file and its form), apart from the JSON bodies'
``max_body_bytes`` (16 MiB), which refused it 413 (audit s31 a4 D6). Real sockets, the real
``Router`` app, a stand-in worker that reads the form; no vLLM."""

from __future__ import annotations

import argparse
import logging

import pytest
from aiohttp import ClientSession, FormData, web

from kvtier.cli import route
from kvtier.errors import ConfigError
from kvtier.router.config import RouterConfig, WorkerSpec
from tests.router.test_http import free_port, run, start_router

VLLM_AUDIO_CAP = 25 << 20   # VLLM_MAX_AUDIO_CLIP_FILESIZE_MB = 25, read as MiB (bytes / 1024**2)


class SpeechWorker:
    """A worker that serves ``/v1/audio/transcriptions`` as vLLM takes it (any form up to well
    over vLLM's cap), answering the audio file's size; the paths the router polls besides."""

    def __init__(self) -> None:
        self.port = free_port()
        self.files: list[int] = []
        self.runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/audio/transcriptions", self.transcribe)
        app.router.add_post("/v1/completions", self.transcribe)
        app.router.add_get("/health", lambda request: web.Response())
        app.router.add_get("/v1/models", lambda request: web.json_response({"object": "list", "data": []}))
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        await self.runner.cleanup()

    async def transcribe(self, request):
        if request.content_type != "multipart/form-data":
            return web.json_response({"text": "json"})
        form = await request.post()
        self.files.append(len(form["file"].file.read()))
        return web.json_response({"text": "hello"})


def audio_form(size: int) -> FormData:
    form = FormData()
    form.add_field("file", b"\x00" * size, filename="a.wav", content_type="audio/wav")
    form.add_field("model", "tiny")
    return form


async def transcribe(url: str, size: int) -> tuple[int, str]:
    async with ClientSession() as s:
        async with s.post(url + "/v1/audio/transcriptions", data=audio_form(size)) as r:
            return r.status, await r.text()


def test_an_audio_file_as_large_as_vllm_takes_is_forwarded_whole():
    """A 25 MiB audio file, vLLM's cap, in its form: forwarded and transcribed under the
    default limits. Before, 413 (``max_body_bytes``, 16 MiB)."""
    async def main():
        w = SpeechWorker()
        await w.start()
        router, runner, url = await start_router([w])
        try:
            status, text = await transcribe(url, VLLM_AUDIO_CAP)
            assert status == 200 and "hello" in text, (status, text[:200])
            assert w.files == [VLLM_AUDIO_CAP]
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())


def test_the_form_cap_is_set_apart_from_the_json_bodies_cap():
    """``max_form_body_bytes`` bounds the audio forms alone: a form over it is a 413, never
    forwarded; a JSON body over ``max_body_bytes`` is still a 413 while a form of that size
    passes."""
    async def main():
        w = SpeechWorker()
        await w.start()
        router, runner, url = await start_router([w], max_body_bytes=64 << 10, max_form_body_bytes=1 << 20)
        try:
            status, text = await transcribe(url, 2 << 20)
            assert status == 413 and w.files == []
            # the 413 names the setting that refused it (before: max_body_bytes, for a form too)
            assert f"max_form_body_bytes = {1 << 20}" in text, text
            status, _ = await transcribe(url, 100 << 10)
            assert status == 200 and w.files == [100 << 10]
            async with ClientSession() as s:
                async with s.post(url + "/v1/completions", json={"prompt": "a " * (50 << 10)}) as r:
                    assert r.status == 413
                    assert f"max_body_bytes = {64 << 10}" in (await r.json())["error"]["message"]
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())


def test_the_form_cap_is_read_as_a_size_and_checked():
    def config(**kw):
        return RouterConfig(workers=[WorkerSpec("http://w")], **kw).check()
    assert config().max_form_body_bytes >= VLLM_AUDIO_CAP + (1 << 20)
    assert config(max_form_body_bytes="40MiB").max_form_body_bytes == 40 << 20
    for bad in (0, -1, "lots", 1.5):
        with pytest.raises(ConfigError, match="max_form_body_bytes"):
            config(max_form_body_bytes=bad)


def test_a_form_under_its_cap_fits_the_bodies_in_flight_bounds():
    """``max_inflight_body_bytes`` 128 MiB and the form cap set to 32 MiB, settings the router
    takes: one address's arriving bodies are bounded at an eighth of it, floored at the largest
    body taken, the form cap. A 20 MB audio form is forwarded, twice. Before, the floor was
    ``max_body_bytes`` (16 MiB), and every form over it was answered 429, a retryable status, on
    every retry, though it could never fit (audit s31 r3 D2). (The form cap set: left unset, it is
    sized under the bound instead, audit s31 r7 D5.)"""
    async def main():
        w = SpeechWorker()
        await w.start()
        router, runner, url = await start_router([w], max_inflight_body_bytes=128 << 20,
                                                 max_form_body_bytes="32MiB")
        try:
            assert router.config.arriving_body_bytes_per_peer() == router.config.max_form_body_bytes
            for _ in range(2):
                status, text = await transcribe(url, 20_000_000)
                assert status == 200, (status, text[:200])
            assert w.files == [20_000_000] * 2
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())


@pytest.mark.parametrize("bounds, sized", [({"max_inflight_body_bytes": "20MiB"}, 16 << 20),
                                           ({"max_arriving_body_bytes_per_peer": "20MiB"}, 20 << 20)])
def test_body_bounds_under_the_form_cap_set_are_refused_naming_it(bounds, sized):
    """A bound on the bodies held at once under a form cap set (32 MiB) would refuse every larger
    form 429 for ever: refused at start, naming the form cap, as a bound under ``max_body_bytes``
    is. Before, taken. Control: with the form cap lowered to fit, taken; left unset, it is sized
    to the bounds (one address's, by default ``max_body_bytes`` under 128 MiB in flight: audit s31
    r7 D5)."""
    def config(**kw):
        return RouterConfig(workers=[WorkerSpec("http://w")], **bounds, **kw).check()
    with pytest.raises(ConfigError, match=r"at least max_form_body_bytes \(33554432\)"):
        config(max_form_body_bytes="32MiB")
    assert config(max_form_body_bytes="16MiB").max_form_body_bytes == 16 << 20
    assert config().max_form_body_bytes == sized


@pytest.mark.parametrize("bounds, form_cap, per_peer", [
    ({"max_inflight_body_bytes": 16 << 20}, 16 << 20, 16 << 20),
    ({"max_body_bytes": 1 << 20, "max_inflight_body_bytes": 8 << 20}, 1 << 20, 1 << 20),
    ({"max_arriving_body_bytes_per_peer": 16 << 20}, 16 << 20, 16 << 20),
    ({"max_inflight_body_bytes": 128 << 20}, 16 << 20, 16 << 20),
    ({}, 32 << 20, 128 << 20),
    ({"max_body_bytes": 64 << 20}, 64 << 20, 128 << 20),
], ids=["inflight=max_body", "small-box", "per-peer=max_body", "inflight-128MiB", "control-defaults",
        "max_body-over-the-default"])
def test_a_text_only_deployments_body_bounds_start_with_the_form_cap_unset(bounds, form_cap, per_peer, caplog):
    """Body bounds that started before the form cap existed (at least ``max_body_bytes``) still
    start with ``max_form_body_bytes`` unset: it is lowered to the bounds on bodies held at once
    (logged), and one address's default bound stays floored at ``max_body_bytes``, not raised to
    the form cap. Before, each was refused at start, and an eighth of 128 MiB rose from 16 to 32
    MiB (audit s31 r7 D5). Control: the defaults keep the 32 MiB form cap, unlogged; a
    ``max_body_bytes`` over it raises it to match, unlogged (audit s32 a1 D4)."""
    with caplog.at_level(logging.INFO, logger="kvtier.router.config"):
        config = RouterConfig(workers=[WorkerSpec("http://w")], **bounds).check()
        config.check()   # (Router() checks it again: sized again, the same, logged once)
    assert (config.max_form_body_bytes, config.arriving_body_bytes_per_peer()) == (form_cap, per_peer)
    logged = [r.getMessage() for r in caplog.records if "max_form_body_bytes (unset)" in r.getMessage()]
    assert len(logged) == (form_cap < 32 << 20), logged


def test_a_form_over_the_form_cap_sized_to_the_bounds_is_refused_413_not_429():
    """``max_inflight_body_bytes`` 128 MiB, the form cap unset: sized to one address's bound, 16
    MiB, so a 20 MB form is refused 413 naming the form cap (not a retryable 429 for ever, audit
    s31 r3 D2), and a 10 MB one is forwarded."""
    async def main():
        w = SpeechWorker()
        await w.start()
        router, runner, url = await start_router([w], max_inflight_body_bytes=128 << 20)
        try:
            status, text = await transcribe(url, 20_000_000)
            assert status == 413 and f"max_form_body_bytes = {16 << 20}" in text, (status, text[:200])
            status, text = await transcribe(url, 10_000_000)
            assert status == 200 and w.files == [10_000_000], (status, text[:200])
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())


def test_a_form_under_a_raised_max_body_bytes_is_forwarded_with_the_form_cap_unset():
    """``max_body_bytes`` raised to 64 MiB, the form cap unset: before the form cap existed, that
    was how a deployment took audio files larger than 32 MiB (workers with a raised
    ``VLLM_MAX_AUDIO_CLIP_FILESIZE_MB``). The unset cap is never under ``max_body_bytes``, so a 40 MB
    form is forwarded whole. Before, it was capped at its 32 MiB default and refused 413: forms got
    less than JSON bodies (audit s32 a1 D4). Control: a form over 64 MiB is still a 413."""
    async def main():
        w = SpeechWorker()
        await w.start()
        router, runner, url = await start_router([w], max_body_bytes=64 << 20)
        try:
            assert router.config.max_form_body_bytes == 64 << 20
            status, text = await transcribe(url, 40_000_000)
            assert status == 200 and w.files == [40_000_000], (status, text[:200])
            status, text = await transcribe(url, (64 << 20) + 1)
            assert status == 413 and "max_form_body_bytes" in text, (status, text[:200])
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())


def test_kvtier_route_takes_the_form_cap_as_a_flag():
    """``kvtier route --max-form-body-bytes`` sets the form cap, as ``--max-body-bytes`` sets the JSON
    bodies' (before: the config file only)."""
    parser = argparse.ArgumentParser()
    route.register(parser.add_subparsers())
    args = parser.parse_args(["route", "--worker", "http://127.0.0.1:1", "--max-form-body-bytes", "40MiB"])
    assert route.build_config(args).max_form_body_bytes == 40 << 20
