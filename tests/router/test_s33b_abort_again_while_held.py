"""A client leaves a stream before its first byte and sends it again under the same id while the
worker is busy: the router posts the abort of that id again ``abort_again_s`` later, while the
retry is held for admission. vLLM applies an abort when its API server gets to it (late beside a
busy engine), so the retry must reach the worker only once that post is answered too, and hold no
admission tokens while it waits (audit s33 r5 D1; s33 a5 D3). Real ``Router`` app over real
sockets, test_retry_under_an_aborted_id.py's stand-in worker; no vLLM."""

from __future__ import annotations

import asyncio

from aiohttp import ClientSession, ClientTimeout

from tests.router.test_http import run, start_router, until
from tests.router.test_retry_under_an_aborted_id import LateAborts


class SlowHeads(LateAborts):
    """:class:`LateAborts` whose requests of the ids in ``head_s`` (each once) reach the engine, and
    so send their first byte, that many seconds after they arrive; ``came`` lists each arrival."""

    def __init__(self, name: str, head_s: dict[str, float], **kw) -> None:
        super().__init__(name, **kw)
        self.head_s = head_s
        self.came: list[str | None] = []

    async def complete(self, request):
        rid = request.headers.get("X-Request-Id")
        self.came.append(rid)
        await asyncio.sleep(self.head_s.pop(rid, 0.0))
        return await super().complete(request)


JOB_7 = {"X-Request-Id": "job-7"}
BODY = {"prompt": "aa bb cc dd ee", "stream": True}                              # 5 tokens
BUSY = {"X-Request-Id": "job-8"}, {"prompt": "xx yy zz ww vv uu tt ss", "stream": True}   # 8: the whole cap


async def stream(s: ClientSession, url: str, headers: dict, body: dict) -> tuple[int, str]:
    async with s.post(url + "/v1/completions", json=body, headers=headers, timeout=ClientTimeout(total=30)) as r:
        return r.status, await r.text()


async def left_then_busy(s: ClientSession, url: str, w: SlowHeads) -> asyncio.Future:
    """``job-7``'s client leaves before its first byte (its abort reaches the worker), then client
    B streams ``job-8`` to the same worker; returns B's answer to come."""
    first = asyncio.ensure_future(stream(s, url, JOB_7, BODY))
    await until(lambda: "job-7" in w.came, timeout_s=5)
    await asyncio.sleep(0.1)
    first.cancel()   # before its first byte: the abort is posted (and again later, if so set)
    await until(lambda: w.abort_posts, timeout_s=5)
    busy = asyncio.ensure_future(stream(s, url, *BUSY))
    await until(lambda: "job-8" in w.came, timeout_s=5)
    return busy


def test_a_retry_held_for_admission_waits_for_the_abort_posted_again_meanwhile():
    """t=0: the first abort of ``job-7`` reaches the worker (answered and applied 1.2 s later); it
    is posted again at about 1.5 s (applied at about 2.7 s). Client B's stream (``job-8``, the whole
    admission cap) sends its first byte at 2.0 s; the retry of ``job-7`` is held behind it. Before,
    it was sent at 2.0 s, and the again-posted abort ended it at 2.7 s. Now it is sent once that
    post is answered, and runs whole; while it waits, it holds no admission tokens."""
    async def main():
        w = SlowHeads("w0", {"job-7": 0.4, "job-8": 2.0}, late_s=1.2, steps=30, gap_s=0.05)   # 1.5 s a stream
        await w.start()
        router, runner, url = await start_router([w], admission_tokens=8, abort_again_s=(1.5,))
        admission = router._admission(router.workers[0])
        try:
            async with ClientSession() as s:
                busy = await left_then_busy(s, url, w)
                retried = asyncio.ensure_future(stream(s, url, JOB_7, BODY))
                await until(lambda: len(w.abort_posts) == 2 and "job-8" in {rid for rid, _ in w.arrived},
                            timeout_s=5)
                await asyncio.sleep(0.3)   # B's first byte released the retry: it waits for the again-post
                assert not retried.done() and w.came.count("job-7") == 1, w.came
                assert (admission.queue.sent_tokens, admission.held) == (0, 0), admission.queue.sent_tokens
                status, text = await retried
                assert (await busy)[0] == 200
            assert status == 200 and "[DONE]" in text, (status, text[-80:])
            retry_at = [t for rid, t in w.arrived if rid == "job-7"][1]
            assert len(w.answered) == 2 and retry_at >= w.answered[1], (w.answered, retry_at)
            assert (w.aborted, w.finished) == (0, 2), (w.aborted, w.finished)   # (the first died with its connection)
            assert router._unanswered_aborts == {} and router._named_on == {}
            assert (admission.queue.sent_tokens, admission.held) == (0, 0)
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())


def test_a_retry_admitted_with_no_abort_of_its_id_unanswered_goes_at_once():
    """The control: the same departure with no abort posted again (``abort_again_s=()``); the
    retry is held behind B only, and is sent with B's first byte (no wait for anything more)."""
    async def main():
        w = SlowHeads("w0", {"job-7": 0.4, "job-8": 1.5}, late_s=0.3, steps=10, gap_s=0.05)
        await w.start()
        router, runner, url = await start_router([w], admission_tokens=8, abort_again_s=())
        try:
            async with ClientSession() as s:
                busy = await left_then_busy(s, url, w)
                (status, text), (busy_status, _) = await asyncio.gather(stream(s, url, JOB_7, BODY), busy)
            assert status == busy_status == 200 and "[DONE]" in text, (status, text[-80:])
            busy_at = next(t for rid, t in w.arrived if rid == "job-8")
            retry_at = [t for rid, t in w.arrived if rid == "job-7"][1]
            assert len(w.abort_posts) == 1 and 0 <= retry_at - busy_at < 0.5, (w.abort_posts, retry_at - busy_at)
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())
