"""``kvtier top`` against endpoints that are slow, huge or answer labels with markup in them
(audit s26 D7-D10): each is shown (down, or as it is), never a hang or a crash."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kvtier.cli import top
from kvtier.cli.main import main
from kvtier.cli.top import scrape
from tests.cli_top.test_scrape_hostile import RawPeer, _http


def _run(argv, capsys) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    out = capsys.readouterr()
    return rc, out.out + out.err


class DripPeer:
    """A real HTTP peer that answers 200 with a large Content-Length (or ``body`` then closes),
    then one byte every ``every_s``: an overloaded or half-broken exporter, or proxy."""

    def __init__(self, every_s: float = 0.5, body: bytes | None = None) -> None:
        self.every_s, self.body = every_s, body
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            conn.recv(65536)
            length = 1_000_000 if self.body is None else len(self.body)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n" % length)
            for i in range(length):
                if self.stop.wait(self.every_s):
                    return
                try:
                    conn.sendall(b"#" if self.body is None else self.body[i:i + 1])
                except OSError:
                    return

    def close(self) -> None:
        self.stop.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.thread.join(5)


# --- D7: one deadline for the whole answer, and a size cap ---

def test_a_dripping_endpoint_is_down_within_its_timeout_not_a_hang():
    peer = DripPeer()
    result: list = []
    t = threading.Thread(target=lambda: result.append(scrape(peer.url, timeout_s=2.0)), daemon=True)
    started = time.monotonic()
    t.start()
    t.join(10)
    waited = time.monotonic() - started
    peer.close()          # ends the scrape either way
    t.join(10)
    assert waited < 4, f"scrape(timeout_s=2) was still reading after {waited:.1f} s"   # old code: > 10 s
    assert result and not result[0].up and "time" in result[0].error, result


def test_control_a_slow_but_complete_answer_within_the_timeout_is_read():
    body = b"vllm:num_requests_running 7\n"
    peer = DripPeer(every_s=0.01, body=body)   # ~0.3 s in all: slow reads, each well inside the deadline
    try:
        samples = scrape(peer.url, timeout_s=5.0)
    finally:
        peer.close()
    assert samples.up and samples.get("vllm:num_requests_running") == 7, samples.error


def test_an_oversized_metrics_body_is_refused_not_read_whole():
    body = b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n" + b"# pad\n" * ((64 << 20) // 6)
    peer = RawPeer(_http(body))
    try:
        samples = scrape(peer.url, timeout_s=10)
    finally:
        peer.close()
    assert not samples.up and "limit" in samples.error, "a 64 MiB /metrics answer was read whole and accepted"


def test_an_oversized_body_without_a_length_is_refused_by_what_was_read(monkeypatch):
    monkeypatch.setattr(top, "MAX_METRICS_BYTES", 1 << 20)
    body = b"vllm:num_requests_running 1\n" + b"# pad\n" * ((2 << 20) // 6)
    peer = RawPeer(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n" + body)
    try:
        samples = scrape(peer.url, timeout_s=10)
    finally:
        peer.close()
    assert not samples.up and "limit" in samples.error


def test_control_a_large_body_under_the_cap_is_read():
    body = b"vllm:num_requests_running 2\n" + b"# pad\n" * ((4 << 20) // 6)   # 4 MiB: a big server's answer
    peer = RawPeer(_http(body))
    try:
        samples = scrape(peer.url, timeout_s=10)
    finally:
        peer.close()
    assert samples.up and samples.get("vllm:num_requests_running") == 2


def test_one_slow_endpoint_does_not_delay_the_others_by_its_timeout_each(capsys):
    slow = [DripPeer() for _ in range(3)]
    result: list = []
    t = threading.Thread(target=lambda: result.append(main(["top", *(a for p in slow for a in ("--worker", p.url)),
                                                             "--once"])), daemon=True)
    started = time.monotonic()
    t.start()
    t.join(15)
    took = time.monotonic() - started
    for p in slow:
        p.close()          # ends the scrapes either way (old code: each scrape read until its peer stopped)
    t.join(10)
    assert took < 5, f"three slow workers took {took:.1f} s: scraped one after another"   # 3 x 2 s in turn
    assert result == [0] and "down" in capsys.readouterr().out


# --- D8: labels are text, never rich markup ---

def _router_metrics(worker: str) -> bytes:
    return _http(('# TYPE kvtier_router_requests_total counter\n'
                  f'kvtier_router_requests_total{{worker="{worker}"}} 3\n').encode())


def test_an_ipv6_worker_address_is_shown_as_it_is(capsys):
    peer = RawPeer(_router_metrics("http://[fd00::1]:8000"))
    try:
        rc, out = _run(["top", "--router", peer.url, "--once"], capsys)
    finally:
        peer.close()
    assert rc == 0
    assert "http://[fd00::1]:8000" in out, out     # was "http://:8000": the host taken for a style tag


def test_a_label_with_a_closing_tag_is_not_a_crash(capsys):
    text = ('# TYPE kvtier_planner_last_decision_info gauge\n'
            'kvtier_planner_last_decision_info{pool="prefill",action="[bold]hold",reason="queue [/x] grew"} 1\n'
            'kvtier_planner_workers{pool="prefill"} 2\nkvtier_planner_target_workers{pool="prefill"} 3\n')
    peer = RawPeer(_http(text.encode()))
    try:
        rc, out = _run(["top", "--planner", peer.url, "--once"], capsys)   # old code: rich MarkupError
    finally:
        peer.close()
    assert rc == 0 and "queue [/x] grew" in out and "[bold]hold" in out and "2 → 3" in out, out


# --- D9: a NaN or infinite planner gauge ---

@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf"])
def test_a_non_finite_planner_gauge_is_shown_as_unknown_not_a_crash(value, capsys):
    text = ('kvtier_planner_last_decision_info{pool="prefill",action="hold",reason="ok"} 1\n'
            f'kvtier_planner_workers{{pool="prefill"}} {value}\nkvtier_planner_target_workers{{pool="prefill"}} 2\n')
    peer = RawPeer(_http(text.encode()))
    try:
        rc, out = _run(["top", "--planner", peer.url, "--once"], capsys)   # old code: int(nan) raised
    finally:
        peer.close()
    assert rc == 0 and "- → 2" in out, out


# --- D10: a malformed address ---

@pytest.mark.parametrize("flag", ["--server", "--router", "--worker", "--planner"])
def test_a_malformed_address_is_refused_naming_its_flag(flag, capsys):
    rc, out = _run(["top", flag, "http://[::1", "--once"], capsys)   # old code: ValueError traceback
    assert rc == 2 and flag in out and "http://[::1" in out, out


def test_scrape_of_a_malformed_address_is_down_not_a_raise():
    samples = scrape("http://[::1", timeout_s=1)
    assert not samples.up and samples.error


def test_control_a_refused_port_is_still_shown_down_with_exit_0(capsys):
    s = socket.create_server(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    rc, out = _run(["top", "--server", f"127.0.0.1:{port}", "--once"], capsys)
    assert rc == 0 and "down: server" in out
