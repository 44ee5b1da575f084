"""Admission's count of the tokens sent to a worker goes back to 0 whatever its held requests
do (audit s33 a5 D2, D3): a held request whose client leaves in the moment it is released, and a
retry that waits for an abort of its id before it is sent. Left counted, those tokens held every
later stream to an idle worker. The real ``AsyncAdmission`` on a real event loop; the real
``Router`` app over real sockets with test_retry_under_an_aborted_id.py's stand-in worker."""

from __future__ import annotations

import asyncio
import time

from aiohttp import ClientSession, ClientTimeout

from kvtier.router.admission import AdmissionQueue, AsyncAdmission
from tests.router.test_http import leave_early, run, start_router, until
from tests.router.test_retry_under_an_aborted_id import LateAborts


def test_a_held_request_cancelled_as_it_is_released_gives_its_tokens_back():
    """B is held behind A. B's client leaves (its task cancelled: the waiter is cancelled at once,
    the task's own handling runs later) and, in the same loop iteration, A's first byte releases
    B. Before, B was counted as sent and never given back: 100 tokens stayed counted on an idle
    worker, and C, and every later request, was held there for good."""
    async def main():
        adm = AsyncAdmission(cap_tokens=100)
        assert await adm.admit(100, 0.0)                      # A: sent
        b = asyncio.ensure_future(adm.admit(100, 1.0))       # B: held behind A
        await asyncio.sleep(0)
        assert adm.held == 1
        b.cancel()        # B's client leaves...
        adm.done(100)     # ...and A's first byte comes before B's task runs again
        await asyncio.gather(b, return_exceptions=True)
        assert b.cancelled()
        assert adm.queue.sent_tokens == 0 and adm.held == 0
        adm.queue.check_integrity()
        c = asyncio.ensure_future(adm.admit(10, 2.0))        # the idle worker takes C at once
        await asyncio.sleep(0)
        assert c.done() and c.result() and adm.queue.sent_tokens == 10
    run(main())


def test_a_gone_item_is_dropped_as_withdrawn_and_the_next_one_released():
    q = AdmissionQueue(cap_tokens=10)
    assert q.offer(10, 0.0, "sent")
    assert not q.offer(10, 1.0, "left") and not q.offer(10, 2.0, "next")
    assert q.done(10, gone=lambda item: item == "left") == ["next"]
    assert q.sent_tokens == 10 and len(q) == 0
    q.check_integrity()


def test_a_retry_waiting_for_an_abort_of_its_id_holds_no_admission_tokens():
    """A client leaves a stream (``job-7``) and sends it again under its id; the worker answers
    the abort 3 s late, so the retry waits for it. Client B (another id) streams to the same idle
    worker meanwhile and gets its first byte at once. Before, the retry was admitted before its
    wait: its tokens were counted as sent for the whole wait, and B was held behind them (~3 s)."""
    async def main():
        w = LateAborts("w0", late_s=3.0, steps=20, gap_s=0.05)   # 1 s a stream
        await w.start()
        router, runner, url = await start_router([w], admission_tokens=8, abort_again_s=())
        same = {"X-Request-Id": "job-7"}
        try:
            async with ClientSession() as s:
                body = {"prompt": "aa bb cc dd ee", "stream": True}
                await leave_early(s, url, "/v1/completions", body, headers=same, worker=w)
                await until(lambda: w.abort_posts, timeout_s=5)

                async def retry():
                    async with s.post(url + "/v1/completions", json=body, headers=same,
                                      timeout=ClientTimeout(total=30)) as r:
                        return r.status, await r.text()
                retried = asyncio.ensure_future(retry())
                await asyncio.sleep(0.3)
                assert not retried.done() and router._unanswered_aborts   # (waiting for the abort)
                t0 = time.monotonic()
                other = {"prompt": "xx yy zz ww vv uu tt ss", "stream": True}   # 8 tokens: the whole cap
                async with s.post(url + "/v1/completions", json=other, headers={"X-Request-Id": "job-8"},
                                  timeout=ClientTimeout(total=30)) as r:
                    first = await r.content.readany()
                    first_byte_s = time.monotonic() - t0
                    await r.read()
                status, text = await retried
            assert r.status == 200 and first, (r.status, first)
            assert first_byte_s < 1.5, f"B waited {first_byte_s:.2f} s behind the retry's abort wait"
            assert status == 200 and "[DONE]" in text, (status, text[-80:])
            assert router.admission[router.workers[0].id].queue.sent_tokens == 0
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())
