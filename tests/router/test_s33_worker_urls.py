"""A worker URL whose host cannot be resolved at all (a DNS label empty or over 63 characters:
``socket.getaddrinfo`` IDNA-encodes the host and raises ``UnicodeError``, which aiohttp passes on
as it is) is refused wherever a worker is given (audit s33 a5 D5). Given to a ``Router`` all the
same (built without ``WorkerSpec.parse``), it fails its health checks without ending them for the
other workers, and the requests sent to it go elsewhere. Real ``Router`` app over real sockets,
test_http.py's stand-in workers."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from aiohttp import ClientSession

from kvtier.errors import ConfigError
from kvtier.router.config import RouterConfig, WorkerSpec
from tests.router.test_http import StandIn, run, start_router, until

LONG_LABEL = "http://" + "a" * 64 + ".example:8000"


@pytest.mark.parametrize("url", [LONG_LABEL, "http://a..b:8000", "http://.a:8000"])
def test_a_worker_host_that_cannot_be_resolved_is_refused(url, tmp_path):
    with pytest.raises(ConfigError, match="cannot be resolved"):
        WorkerSpec.parse(url)                                   # (--worker and the admin API parse so)
    path = tmp_path / "router.toml"
    path.write_text(f'[[worker]]\nurl = "{url}"\n')
    with pytest.raises(ConfigError, match="cannot be resolved"):
        RouterConfig.from_file(path)


@pytest.mark.parametrize("url, named", [("http://" + "a" * 63 + ".example:8000",) * 2,
                                        ("http://bücher.example:8000", "http://xn--bcher-kva.example:8000"),
                                        ("http://[::1]:8000",) * 2, ("http://my_host:8000",) * 2,
                                        ("https://worker-1",) * 2])
def test_a_worker_host_that_resolves_is_taken(url, named):
    # (an IDNA name is named in the form aiohttp connects to: audit s34 r9 D1)
    assert WorkerSpec.parse(url).url == named


def test_the_admin_api_refuses_a_worker_host_that_cannot_be_resolved():
    async def main():
        w = StandIn("w0")
        await w.start()
        router, runner, url = await start_router([w])
        try:
            async with ClientSession() as s:
                async with s.post(url + "/admin/workers", json={"url": LONG_LABEL}) as r:
                    assert r.status == 400 and "cannot be resolved" in await r.text()
            assert [x.url for x in router.workers] == [w.url]
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())


def test_an_unresolvable_worker_fails_its_own_health_checks_and_no_others(caplog):
    """The bad worker is ejected by its checks; the good one is still checked: ejected while it
    is down, re-admitted once it is back. Before, the bad worker's UnicodeError ended the health
    loop at its first round, and an ejected worker was never re-admitted."""
    async def main():
        good = StandIn("good")
        await good.start()
        router, runner, url = await start_router([SimpleNamespace(url=LONG_LABEL), good])
        try:
            bad = router.workers[0]
            await until(lambda: not bad.healthy, timeout_s=3)
            assert not bad.healthy and not router._tasks[0].done()
            good.down = True
            await until(lambda: not router.workers[1].healthy, timeout_s=3)
            assert not router.workers[1].healthy
            good.down = False
            await until(lambda: router.workers[1].healthy, timeout_s=3)
            assert router.workers[1].healthy and not router._tasks[0].done()
        finally:
            await runner.cleanup()
            await good.stop()
        failed = [r for r in caplog.records if "its health check failed" in r.getMessage()]
        assert len(failed) == 1, [r.getMessage() for r in failed]   # logged once, not at each round
    caplog.set_level(logging.WARNING, logger="kvtier.router.app")
    run(main())


def test_a_request_sent_to_an_unresolvable_worker_is_retried_elsewhere():
    """Round robin sends every other request to the bad worker (its checks would eject it only
    after 1,000 failures here): each is answered by the good one. Before, each was answered 400
    "the request cannot be forwarded", as if it were the client's fault, and never retried."""
    async def main():
        good = StandIn("good")
        await good.start()
        router, runner, url = await start_router([SimpleNamespace(url=LONG_LABEL), good], policy="round-robin",
                                                 eject_after=1000)
        try:
            async with ClientSession() as s:
                for i in range(4):
                    async with s.post(url + "/v1/completions", json={"prompt": f"p{i} q r s"}) as r:
                        assert r.status == 200, (r.status, await r.text())
                        assert r.headers["X-Kvtier-Worker"] == good.url
            assert good.requests == 4
            assert router.metrics.errors.labels("internal")._value.get() == 0
        finally:
            await runner.cleanup()
            await good.stop()
    run(main())
