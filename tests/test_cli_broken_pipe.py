"""A command whose stdout reader leaves early (``| head -1``, a pager quit) ends quietly, exit 141
(128 + SIGPIPE, as a shell reports it), not with a BrokenPipeError traceback (audit s32 a7 D5).
Made deterministic: the read end of the child's stdout pipe is closed before the child writes.
So does one whose stdout is a socket (systemd ``StandardOutput=socket``, inetd, socat) whose peer
closed: poll shows POLLHUP there, not a pipe's POLLERR, and the traceback stayed (s32 r1 D2)."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys

import pytest

CAPACITY = [sys.executable, "-m", "kvtier.cli.main", "plan", "capacity", "--model", "llama-3-8b", "--users", "1",
            "--context-tokens", "1"]


def _run_with_stdout(argv: list[str], stdout: int) -> subprocess.CompletedProcess:
    return subprocess.run(argv, stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})


def _run_with_reader_gone(argv: list[str]) -> subprocess.CompletedProcess:
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return _run_with_stdout(argv, write_end)
    finally:
        os.close(write_end)


def _unix_socket_peer_gone() -> socket.socket:
    ours, peer = socket.socketpair()
    peer.close()
    return ours


def _tcp_socket_peer_gone() -> socket.socket:
    """A TCP connection whose peer closed and reset it: a byte sent to the closed peer brings the
    reset back (as the command's first write would), so that the command's first write fails."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        ours = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
    peer.close()
    ours.send(b"x")
    poller = select.poll()
    poller.register(ours, select.POLLOUT)
    assert any(events & select.POLLHUP for _, events in poller.poll(10_000)), "no reset from the closed peer"
    return ours


@pytest.mark.parametrize("json_flag", [[], ["--json"]], ids=["table written in the command", "json flushed at its end"])
def test_a_reader_gone_ends_the_command_quietly(json_flag):
    done = _run_with_reader_gone(CAPACITY + json_flag)
    assert done.returncode == 141 and done.stderr == "", done.stderr[-2000:]


@pytest.mark.parametrize("connect", [_unix_socket_peer_gone, _tcp_socket_peer_gone], ids=["unix socket", "tcp socket"])
def test_a_socket_stdout_whose_peer_closed_ends_the_command_quietly(connect):
    ours = connect()
    try:
        done = _run_with_stdout(CAPACITY, ours.fileno())
    finally:
        ours.close()
    assert done.returncode == 141 and done.stderr == "", done.stderr[-2000:]


def test_control_with_its_reader_the_command_prints_and_exits_0():
    done = subprocess.run(CAPACITY + ["--json"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0 and done.stdout.startswith('{"model": "llama-3-8b"'), done.stderr[-2000:]


def test_a_broken_pipe_elsewhere_is_not_taken_for_stdouts_reader(monkeypatch, tmp_path):
    """A peer's socket closing is a real failure, kept with its traceback: only a stdout whose
    reader left counts, never a file, a pipe still read or a socket whose peer is there."""
    from kvtier.cli.main import _stdout_reader_gone

    with open(tmp_path / "out.txt", "w") as file:
        monkeypatch.setattr(sys, "stdout", file)
        assert not _stdout_reader_gone()
    read_end, write_end = os.pipe()
    with os.fdopen(write_end, "w") as pipe:
        monkeypatch.setattr(sys, "stdout", pipe)
        assert not _stdout_reader_gone()
        os.close(read_end)
        assert _stdout_reader_gone()
        monkeypatch.undo()
    ours, peer = socket.socketpair()
    with ours, os.fdopen(os.dup(ours.fileno()), "w") as sock:
        monkeypatch.setattr(sys, "stdout", sock)
        assert not _stdout_reader_gone()  # its peer still reads
        peer.close()
        assert _stdout_reader_gone()
        monkeypatch.undo()
