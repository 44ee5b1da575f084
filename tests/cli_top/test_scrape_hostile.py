"""``kvtier.cli.top.scrape`` against peers that answer something other than metrics: each is a
down endpoint with its reason, never an exception (``kvtier top`` and the live planner both
scrape through it, and the planner's end drains the workers it started)."""

from __future__ import annotations

import socket
import threading

import pytest

from kvtier.cli.top import scrape


class RawPeer:
    """A real TCP listener that answers every connection with ``reply`` (raw bytes) and closes."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:   # closed
                return
            with conn:
                conn.recv(65536)
                conn.sendall(self.reply)

    def close(self) -> None:
        try:   # wakes the blocked accept() (close() alone does not, on Linux)
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.thread.join(5)
        assert not self.thread.is_alive()


def _http(body: bytes, length: int | None = None) -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
            % (len(body) if length is None else length)) + body


REPLIES = {
    "html_page": _http(b"<html><body>502 Bad Gateway</body></html>\n"),
    "sample_not_a_number": _http(b'kvtier_router_requests_total{worker="w"} many\n'),
    "not_utf8": _http(b"vllm:num_requests_running \xff\xfe\n"),
    "not_http_at_all": b"SSH-2.0-OpenSSH_9.6\r\n",
    "truncated_body": _http(b"vllm:num_requests_running 1\n", length=500),
}


@pytest.mark.parametrize("name", sorted(REPLIES))
def test_a_peer_that_does_not_answer_metrics_is_down_with_a_reason(name):
    peer = RawPeer(REPLIES[name])
    try:
        samples = scrape(peer.url, timeout_s=5)
    finally:
        peer.close()
    assert not samples.up and samples.values == {} and samples.error


def test_control_metrics_text_from_the_same_peer_is_read():
    peer = RawPeer(_http(b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 3\n"))
    try:
        samples = scrape(peer.url, timeout_s=5)
    finally:
        peer.close()
    assert samples.up and samples.get("vllm:num_requests_running") == 3
