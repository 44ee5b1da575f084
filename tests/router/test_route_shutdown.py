"""``kvtier route`` shut down by signals: a real router process, a slow stand-in worker
(tests/router/test_http.py's ``Deaf``) that decodes on until it is told to abort by name."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest
from aiohttp import ClientError, ClientSession, ClientTimeout

from tests.router.test_http import Deaf, until

ROOT = Path(__file__).resolve().parents[2]
DRAIN_S = 4.0


@pytest.mark.parametrize("signals", [1, 2])
def test_a_second_sigterm_during_the_drain_ends_it_early_with_a_word_to_each_answer(tmp_path, signals):
    """SIGTERM: the answers under way may go on for ``--drain-timeout-s``, then each still open
    gets an error event (a stream) or a 503 (not yet answered) and is aborted on its worker by
    name. A second SIGTERM during that drain used to reach aiohttp's own handler, still installed
    until its cleanup ended: the drain was abandoned, the stream cut without an error event, the
    unanswered request's connection dropped, exit status 1. Now it ends the drain early, with the
    same word to each. Control (one SIGTERM): the drain lasts its bound."""
    from kvtier.integrations.transformers.models import train_tokenizer

    model = tmp_path / "model"
    train_tokenizer(300, model)

    async def main():
        w = Deaf("w0", steps=200, gap_s=0.05)          # 10 s of decoding, beyond the drain
        await w.start()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvtier.cli.main", "route", "--model-path", str(model), "--kv-bytes-per-token",
            "4096", "--worker", w.url, "--port", "0", "--drain-timeout-s", str(DRAIN_S),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT,
            env={**os.environ, "PYTHONWARNINGS": "ignore"})
        try:
            url = json.loads(await asyncio.wait_for(proc.stdout.readline(), 60))["listen"]
            async with ClientSession() as s:
                async def ask(body):
                    try:
                        async with s.post(url + "/v1/completions", json=body, timeout=ClientTimeout(total=30)) as r:
                            return r.status, await r.read()
                    except ClientError as exc:   # cut without a word
                        return exc.__class__.__name__, b""

                stream = asyncio.ensure_future(ask({"prompt": "a b", "stream": True}))
                whole = asyncio.ensure_future(ask({"prompt": "c d"}))       # answered only at its end
                await until(lambda: w.requests == 2, 10)
                await asyncio.sleep(0.3)
                t0 = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                if signals == 2:
                    await asyncio.sleep(0.4)
                    proc.send_signal(signal.SIGTERM)
                status, body = await stream
                ended = time.monotonic() - t0
                events = [e[len("data: "):] for e in body.decode().split("\n\n") if e.startswith("data: ")]
                assert status == 200 and events[-1] == "[DONE]", (status, events[-3:])
                assert "shutting down" in json.loads(events[-2])["error"]["message"], events[-3:]
                status, body = await whole
                assert status == 503 and json.loads(body)["error"]["type"] == "service_unavailable_error", body
                if signals == 2:
                    assert ended < DRAIN_S - 1.0, ended           # the drain ended early
                else:
                    assert ended > DRAIN_S - 0.5, ended           # control: it lasted its bound
            stderr = (await asyncio.wait_for(proc.communicate(), 30))[1].decode()
            assert proc.returncode == 0 and "Traceback" not in stderr, stderr[-3000:]
            await until(lambda: w.aborted == 2, 5)
            assert w.aborted == 2 and w.finished == 0, (w.aborted, w.finished, w.abort_posts)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await w.stop()

    asyncio.run(asyncio.wait_for(main(), 90))


def test_a_second_sigterm_ends_a_shutdown_held_by_a_slow_request_body(tmp_path):
    """R1. ``kvtier route`` now replaces aiohttp's signal handlers for good: a second SIGTERM/SIGINT
    only calls Router.end_drain(), which ends the answers in ``_active`` (those being forwarded).
    A handler still reading its request body (a slow or stalled upload; or one in tokenization,
    a Messages render) is not in ``_active``: aiohttp's server.shutdown waits up to its
    shutdown_timeout (60 s) for it, and no further signal can hurry that. Before d269433 the
    second signal raised GracefulExit out of the cleanup and the process ended at once.
    Now the second signal ends the drain when there is one to end, and one more (or a second
    once no drain is left) stops at once, as aiohttp's own handler does."""
    from kvtier.integrations.transformers.models import train_tokenizer

    model = tmp_path / "model"
    train_tokenizer(300, model)

    async def main():
        w = Deaf("w0", steps=5, gap_s=0.01)
        await w.start()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvtier.cli.main", "route", "--model-path", str(model), "--kv-bytes-per-token",
            "4096", "--worker", w.url, "--port", "0", "--drain-timeout-s", "2",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT,
            env={**os.environ, "PYTHONWARNINGS": "ignore"})
        conn = None
        try:
            url = json.loads(await asyncio.wait_for(proc.stdout.readline(), 60))["listen"]
            host, port = url.split("://", 1)[1].rsplit(":", 1)
            conn = socket.create_connection((host.strip("[]"), int(port)))
            # headers, then a body that stalls after its first byte (a slow client upload)
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{")
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            proc.send_signal(signal.SIGTERM)          # "stop now"
            await asyncio.sleep(0.5)
            proc.send_signal(signal.SIGTERM)          # and once more
            try:
                await asyncio.wait_for(proc.wait(), 12)
            except asyncio.TimeoutError:
                pass
            took = time.monotonic() - t0
            assert proc.returncode is not None, (
                f"kvtier route still running {took:.1f} s after three SIGTERMs (a slow request body holds "
                "aiohttp's shutdown for its 60 s shutdown_timeout; the second signal no longer ends it)")
        finally:
            if conn is not None:
                conn.close()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await w.stop()

    asyncio.run(asyncio.wait_for(main(), 90))
