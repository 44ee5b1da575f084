"""A worker host is checked the way aiohttp will send to it: yarl maps it by UTS-46 (IDNA 2008)
and only then is it IDNA-encoded for the resolver. ``ab⒈.example`` (U+2488 DIGIT ONE FULL STOP)
passed Python's own IDNA-2003 codec (one label ``ab1.``), but yarl maps it to ``ab1..example``,
an empty label, and aiohttp raised ``UnicodeError`` on each call to it: the admin API took it, and
each request sent there was answered 400 as the client's fault (audit s33 r5 D2). Real ``Router``
app over real sockets, test_http.py's stand-in worker."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import yarl
from aiohttp import ClientSession

from kvtier.errors import ConfigError
from kvtier.router.config import RouterConfig, WorkerSpec
from tests.router.test_http import StandIn, run, start_router

MAPPED_TO_AN_EMPTY_LABEL = "http://ab\u2488.example:8000"


@pytest.mark.parametrize("url", [MAPPED_TO_AN_EMPTY_LABEL, "http://a\u00adb.example:8000"])
def test_a_worker_host_aiohttp_cannot_send_to_is_refused(url, tmp_path):
    """(A soft hyphen, which yarl refuses itself, passed the old check too.)"""
    with pytest.raises(ConfigError, match="cannot be resolved"):
        WorkerSpec.parse(url)
    path = tmp_path / "router.toml"
    path.write_text(f'[[worker]]\nurl = "{url}"\n')
    with pytest.raises(ConfigError, match="cannot be resolved"):
        RouterConfig.from_file(path)


@pytest.mark.parametrize("host", ["[::1]", "[fe80::1%25eth0]", "my_host", "localhost", "localhost.", "123",
                                  "bücher.example", "xn--bcher-kva.example", "a\u3002b"])
def test_a_worker_host_aiohttp_sends_to_is_taken(host):
    url = f"http://{host}:8000"
    sent_to = yarl.URL(url).raw_host   # taken, and named by the host aiohttp connects to (s34 r9 D1)
    assert WorkerSpec.parse(url).url == f"http://{f'[{sent_to}]' if ':' in sent_to else sent_to}:8000"


def test_the_admin_api_refuses_it():
    async def main():
        good = StandIn("good")
        await good.start()
        router, runner, url = await start_router([good])
        try:
            async with ClientSession() as s:
                async with s.post(url + "/admin/workers", json={"url": MAPPED_TO_AN_EMPTY_LABEL}) as r:
                    assert r.status == 400 and "cannot be resolved" in await r.text(), r.status   # (before: 201)
            assert [w.url for w in router.workers] == [good.url]
        finally:
            await runner.cleanup()
            await good.stop()
    run(main())


def test_requests_for_it_go_elsewhere_when_a_router_is_given_it_all_the_same():
    """A ``Router`` given it without ``WorkerSpec.parse`` sends each request meant for it to the good
    worker instead (streamed or whole), and charges the bad one a failure for each. Before, each
    was answered 400 "the request cannot be forwarded", as if it were the client's fault."""
    async def main():
        good = StandIn("good")
        await good.start()
        router, runner, url = await start_router([SimpleNamespace(url=MAPPED_TO_AN_EMPTY_LABEL), good],
                                                 policy="round-robin", eject_after=1000)
        try:
            async with ClientSession() as s:
                for i, stream in enumerate((False, True, False, True)):
                    body = {"prompt": f"p{i} q r s", "stream": stream}
                    async with s.post(url + "/v1/completions", json=body) as r:
                        assert r.status == 200, (r.status, await r.text())
                        assert r.headers["X-Kvtier-Worker"] == good.url
            assert good.requests == 4 and router.workers[0].failures >= 2
        finally:
            await runner.cleanup()
            await good.stop()
    run(main())
