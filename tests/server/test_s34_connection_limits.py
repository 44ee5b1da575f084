"""What a connection holds is given back, and only the connections the config admits are accepted:

* a connection the server closes while its client has stopped reading (the close's ERROR frame
  cannot leave) is reset ``frame_timeout_s`` later, freeing its tenant slot;
* the server raises its soft open-file limit to the hard one, so every login ``max_connections``
  allows gets a descriptor, and warns at start when even the hard limit is too low;
* the Unix socket never accepts a connection while its mode lets anyone in (umask 0).
"""

from __future__ import annotations

import fcntl
import json
import os
import resource
import signal
import socket
import struct
import subprocess
import sys
import termios
import time

import pytest

from kvtier.child_process import die_with_parent
from kvtier.server.launch import ServerProcess, _read_line, write_config
from kvtier.tiers.remote_protocol import HEADER_NBYTES, Op
from tests.server.conftest import connect, frame, hello_frame, logged_in

TOKEN = "acme-token-1"
TENANTS = {"acme": {"token": TOKEN}}


# -- D1: a close the client does not take ------------------------------------------------------------
def _queued_bytes(s: socket.socket) -> int:
    """Bytes waiting in ``s``'s receive queue, unread (Linux: FIONREAD)."""
    return struct.unpack("i", fcntl.ioctl(s.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]


def _settled_queue(s: socket.socket, settle_s: float = 0.3, limit_s: float = 5.0) -> int:
    """The receive queue's length once it has stopped growing."""
    deadline = time.monotonic() + limit_s
    last = -1
    while time.monotonic() < deadline:
        now = _queued_bytes(s)
        if now == last:
            return now
        last = now
        time.sleep(settle_s)
    return last


def _login_when_free(url: str, within_s: float) -> socket.socket | None:
    """A login to ``url`` once the tenant's one slot is free, or None if it never is within ``within_s``."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            return logged_in(url, TOKEN)
        except AssertionError:  # refused: the slot is still held
            time.sleep(0.25)
    return None


def test_a_closed_connection_whose_client_stopped_reading_gives_its_slot_back(tmp_path_factory):
    """The client fills the server's socket buffer with PING replies and stops reading: the idle
    timeout's ERROR frame cannot be written and a graceful close waits for it for ever. The
    tenant's only slot must come back within a few seconds of the 1 s timeouts."""
    workdir = tmp_path_factory.mktemp("s34")
    with ServerProcess.start(TENANTS, unix=True, tcp=False, workdir=str(workdir), server={
            "capacity": "16MiB", "max_block": "1MiB", "idle_timeout_s": 1, "frame_timeout_s": 1,
            "hello_timeout_s": 1, "max_connections": 4, "max_connections_per_tenant": 1}) as srv:
        url = srv.unix_url
        ping = frame(Op.PING)
        # How many PING replies the kernel takes before the server has to keep one itself (that
        # one waits in the SEND phase, and is reset after frame_timeout_s, as it always was).
        probe = logged_in(url, TOKEN)
        probe.sendall(ping * 2000)
        taken = _settled_queue(probe) // HEADER_NBYTES
        assert 10 < taken < 2000, taken
        probe.close()
        # Exactly that many: every reply goes to the kernel, which is then full, and the
        # connection is idle. The idle timeout's ERROR frame is left to the server's buffer.
        stalled = _login_when_free(url, within_s=5)
        assert stalled is not None, "the probe's slot never came back"
        stalled.sendall(ping * taken)
        assert _settled_queue(stalled) == taken * HEADER_NBYTES
        # idle 1 s, then frame_timeout_s 1 s for the close to complete (a watchdog tick each)
        again = _login_when_free(url, within_s=8)
        assert again is not None, "8 s after 1 s timeouts, the stalled client still holds the tenant's slot"
        again.close()
        stalled.close()


# -- D2: the open-file limit --------------------------------------------------------------------------
def _serve_under_open_file_limit(workdir, soft: int, hard: int, server: dict) -> ServerProcess:
    """``kvtier serve`` started with ``RLIMIT_NOFILE`` (soft, hard), as a systemd unit or a shell
    with a low soft limit starts it."""
    config = os.path.join(workdir, "kvtier.toml")
    write_config(config, {"listen": ["tcp://127.0.0.1:0"], "capacity": "16MiB", "max_block": "1MiB", **server},
                 TENANTS)
    log_path = os.path.join(workdir, "serve.log")

    def limited_child():
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        die_with_parent()

    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvtier.server", "--config", config], stdout=subprocess.PIPE,
                                stderr=log, stdin=subprocess.DEVNULL, preexec_fn=limited_child)
    line = _read_line(proc, 30)
    if not line:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        raise AssertionError(f"kvtier serve did not start:\n{open(log_path).read()[-2000:]}")
    info = json.loads(line)
    return ServerProcess(proc, info, str(workdir), False, log_path, list(info["listen"]))


def _open_file_limits(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/limits") as f:
        line = next(line for line in f if line.startswith("Max open files"))
    soft, hard = line.split()[3:5]
    return int(soft), int(hard)


def test_every_login_the_config_admits_gets_a_descriptor_under_a_low_soft_limit(tmp_path):
    """Soft limit 32 (the server holds ~14 descriptors at start), max_connections 40: each of the 40
    logins must be answered, not reset at the soft limit."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 256:
        pytest.skip(f"hard open-file limit {hard}: no room above a low soft one")
    max_connections = 40
    srv = _serve_under_open_file_limit(tmp_path, 32, hard, {
        "max_connections": max_connections, "max_connections_per_tenant": max_connections,
        "max_unauthenticated": 8})
    held = []
    try:
        for i in range(max_connections):
            try:
                held.append(logged_in(srv.tcp_url, TOKEN))
            except OSError as exc:
                pytest.fail(f"login {i + 1} of the {max_connections} allowed failed: {exc!r}")
        assert _open_file_limits(srv.proc.pid) == (hard, hard)
        assert "open-file limit" not in srv.log()  # the hard limit leaves room: nothing to warn of
    finally:
        for s in held:
            s.close()
        srv.stop()


def test_the_start_warns_when_the_hard_open_file_limit_is_below_the_connection_limits(tmp_path):
    """Hard limit 128 < max_connections 100 + max_unauthenticated 16 + the server's own reserve."""
    srv = _serve_under_open_file_limit(tmp_path, 128, 128, {"max_connections": 100, "max_unauthenticated": 16})
    try:
        log = srv.log()
    finally:
        srv.stop()
    warnings = [line for line in log.splitlines() if "WARNING" in line and "open-file limit is 128" in line]
    assert warnings, log
    assert "max_connections 100" in warnings[0] and "LimitNOFILE" in warnings[0]


# -- D3: the Unix socket's mode -----------------------------------------------------------------------
#: the server under umask 0, ``os.chmod`` of its socket wrapped to record, just before the chmod, the
#: socket's mode and whether it already accepts connections
_CHMOD_SPY = r'''
import os, socket, stat, sys
real_chmod = os.chmod
def chmod(path, mode, *args, **kwargs):
    if isinstance(path, str) and path == sys.argv[2]:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(1)
        try:
            s.connect(path)
            accepts = True
        except OSError:
            accepts = False
        s.close()
        sys.stderr.write(f"BEFORE-CHMOD mode={stat.S_IMODE(os.stat(path).st_mode):o} accepts={accepts}\n")
    return real_chmod(path, mode, *args, **kwargs)
os.chmod = chmod
os.umask(0)
from kvtier.server.__main__ import main
sys.exit(main(["--config", sys.argv[1]]))
'''


def test_the_unix_socket_accepts_no_connection_before_its_mode_is_0660(tmp_path):
    path = str(tmp_path / "k.sock")
    config = str(tmp_path / "k.toml")
    write_config(config, {"listen": [f"unix://{path}"], "capacity": "16MiB", "max_block": "1MiB"}, TENANTS)
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", _CHMOD_SPY, config, path], stdout=subprocess.PIPE,
                                stderr=log, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
    try:
        assert '"ready": true' in _read_line(proc, 30), log_path.read_text()
        final_mode = os.stat(path).st_mode & 0o777
        s = connect(f"unix://{path}")  # and it does accept, once listening
        s.sendall(hello_frame(TOKEN))
        s.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        proc.stdout.close()
    seen = [line for line in log_path.read_text().splitlines() if line.startswith("BEFORE-CHMOD")]
    assert seen, log_path.read_text()
    assert "accepts=False" in seen[0], f"the socket took connections before its chmod: {seen[0]}"
    assert final_mode == 0o660
