"""A bearer token goes only to the address it was given for, never where a redirect points.

urllib's redirect handler copies every header of a request (``Authorization`` included) into the
redirected one, whatever host ``Location`` names. ``kvtier top`` (``scrape``, with the server's
metrics or admin token) and the live planner's router client (``RouterAdmin``, with the router's
admin token, which points user traffic at any address) used urllib's default opener: one 302 from
the address given (a proxy in front of it, a moved endpoint, a host taken over) sent the token to
a host of the redirector's choice. Now a request that carries a token does not follow a redirect:
the endpoint is down (``scrape``) or a :class:`LaunchError` (``RouterAdmin``), naming where it
pointed. Real HTTP servers on two loopback addresses (127.0.0.1 and 127.0.0.2: two hosts).
"""

from __future__ import annotations

import argparse
import http.server
import threading

import pytest

from kvtier.cli import top
from kvtier.cli.top import scrape
from kvtier.planner.local_launcher import LaunchError, RouterAdmin

TOKEN = "admin-token-that-erases-every-tenant"
METRICS = b"# TYPE kvtier_stored_blocks gauge\nkvtier_stored_blocks 3.0\n"


class _Recorder(http.server.BaseHTTPRequestHandler):
    """Answers metrics or an empty worker list, and records the headers of each request."""

    seen: list[dict]

    def _answer(self):
        self.seen.append(dict(self.headers))
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        body = METRICS if self.path.startswith("/metrics") else b'{"workers": []}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_DELETE = _answer  # noqa: N815

    def log_message(self, *args):
        pass


def _serve(host: str, handler) -> http.server.ThreadingHTTPServer:
    srv = http.server.ThreadingHTTPServer((host, 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@pytest.fixture
def elsewhere():
    """The host a redirect sends to (127.0.0.2): records what each request carried."""
    seen: list[dict] = []
    srv = _serve("127.0.0.2", type("Elsewhere", (_Recorder,), {"seen": seen}))
    yield f"127.0.0.2:{srv.server_address[1]}", seen
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def redirector(elsewhere):
    """The address the operator gave (127.0.0.1): answers everything with a redirect to the other host."""
    target = f"http://{elsewhere[0]}"

    class Redirect(http.server.BaseHTTPRequestHandler):
        def _redirect(self):
            self.send_response(307 if self.command != "GET" else 302)
            self.send_header("Location", target + self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_POST = do_DELETE = _redirect  # noqa: N815

        def log_message(self, *args):
            pass

    srv = _serve("127.0.0.1", Redirect)
    yield f"127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def direct():
    """An endpoint that answers itself (the positive control): (address, headers seen)."""
    seen: list[dict] = []
    srv = _serve("127.0.0.1", type("Direct", (_Recorder,), {"seen": seen}))
    yield f"127.0.0.1:{srv.server_address[1]}", seen
    srv.shutdown()
    srv.server_close()


def _carried(seen: list[dict]) -> list[str | None]:
    return [h.get("Authorization") for h in seen]


def test_a_scrape_with_a_token_does_not_follow_a_redirect(redirector, elsewhere):
    address, seen = elsewhere
    samples = scrape(redirector, TOKEN, timeout_s=5.0)
    assert not any(TOKEN in (a or "") for a in _carried(seen)), f"the token went to {address}: {_carried(seen)}"
    assert not seen, "the redirect was followed"
    assert not samples.up and "redirected (302)" in samples.error and address in samples.error, samples


def test_a_scrape_without_a_token_still_follows_a_redirect(redirector, elsewhere):
    """Control: nothing to leak, so a worker's /metrics behind a redirect is read as before."""
    samples = scrape(redirector, None, timeout_s=5.0)
    assert samples.up and samples.get("kvtier_stored_blocks") == 3.0, samples
    assert _carried(elsewhere[1]) == [None]


def test_a_scrape_with_a_token_reaches_the_address_given(direct):
    """Control: the token still goes where it was given, and the samples come back."""
    address, seen = direct
    samples = scrape(address, TOKEN, timeout_s=5.0)
    assert samples.up and samples.get("kvtier_stored_blocks") == 3.0, samples
    assert _carried(seen) == [f"Bearer {TOKEN}"]


def test_top_sends_the_metrics_token_from_the_environment(direct, monkeypatch, capsys):
    """``kvtier top`` takes $KVTIER_METRICS_TOKEN first (the server's read-only scrape token), then
    $KVTIER_ADMIN_TOKEN as before; ``--token`` wins over both (with a warning: argv is every local
    user's to read)."""
    address, seen = direct
    parser = argparse.ArgumentParser()
    top.register(parser.add_subparsers())
    monkeypatch.setenv("KVTIER_ADMIN_TOKEN", "the-admin-token")
    monkeypatch.setenv("KVTIER_METRICS_TOKEN", "the-metrics-token")
    for argv, sent in ((["top", "--server", address, "--once"], "the-metrics-token"),
                       (["top", "--server", address, "--once", "--token", "flag-token"], "flag-token")):
        args = parser.parse_args(argv)
        assert args.func(args) == 0
        assert _carried(seen)[-1] == f"Bearer {sent}"
        warned = "visible to every local user" in capsys.readouterr().err
        assert warned == ("--token" in argv), argv
    monkeypatch.delenv("KVTIER_METRICS_TOKEN")
    args = parser.parse_args(["top", "--server", address, "--once"])
    assert args.func(args) == 0
    assert _carried(seen)[-1] == "Bearer the-admin-token"
    assert "3 blocks stored" in capsys.readouterr().out


@pytest.mark.parametrize("call", ["workers", "add", "drain", "remove"])
def test_the_planners_router_client_does_not_follow_a_redirect(redirector, elsewhere, call):
    address, seen = elsewhere
    admin = RouterAdmin(f"http://{redirector}", TOKEN, timeout_s=5.0)
    args = () if call == "workers" else ("http://127.0.0.1:8001",)
    with pytest.raises(LaunchError, match="redirecting to") as err:
        getattr(admin, call)(*args)
    assert address in str(err.value)
    assert not seen, f"the redirect was followed: {_carried(seen)}"


def test_the_planners_router_client_reaches_the_router_given(direct):
    """Control: the router's own address gets the token and its answer is read."""
    address, seen = direct
    assert RouterAdmin(f"http://{address}", TOKEN, timeout_s=5.0).workers() == {}
    assert _carried(seen) == [f"Bearer {TOKEN}"]
