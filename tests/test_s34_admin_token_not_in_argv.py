"""The admin token need never be on the command line, where every local user reads it (``ps``,
``/proc/PID/cmdline`` is 0444): ``kvtier admin`` and ``kvtier top`` take ``--token-file PATH`` (a
private file) or ``--token -`` (stdin), and $KVTIER_ADMIN_TOKEN as before; ``hash-token`` reads
stdin. A token still given as an argument works, with a one-line warning on stderr. The commands
run as processes against a real ``kvtier serve``.

(s34 audit a8 D4: only ``--token TOKEN`` and ``hash-token TOKEN`` took the token. r7 D3: ``kvtier top
--token -`` with an empty stdin ran on without a token, exit 0, not a word said.)"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.server.auth import hash_token
from kvtier.server.launch import ServerProcess
from kvtier.tiers.base import Status
from tests.server.conftest import block, keys_for, remote
from tests.server.harness import SHARED, TOKENS, tenants

ROOT = Path(__file__).resolve().parents[1]
ADMIN = TOKENS["admin"]
WARNING = "visible to every local user"
#: the environment of every call: no token in it unless a test puts one there
ENV = {k: v for k, v in os.environ.items() if k not in ("KVTIER_ADMIN_TOKEN", "KVTIER_METRICS_TOKEN")} | {
    "PYTHONWARNINGS": "ignore"}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    wd = tmp_path_factory.mktemp("kvtier-serve")
    server = ServerProcess.start(tenants(), shared=SHARED, admin_token=ADMIN, workdir=str(wd),
                                 server={"capacity": "16MiB", "max_block": "1MiB", "metrics": "127.0.0.1:0"})
    acme = remote(server, "acme", namespace="top")  # a block: acme has a row in kvtier top's tenants
    try:
        (key,) = keys_for("token-argv", 1)
        assert acme.put(key, block(key)) is Status.OK
    finally:
        acme.close()
    yield server
    server.stop()


@pytest.fixture
def token_file(tmp_path) -> Path:
    path = tmp_path / "admin.token"
    path.write_text(ADMIN + "\n")
    path.chmod(0o600)
    return path


def _kvtier(*argv: str, stdin: str = "", env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtier.cli.main", *argv], input=stdin, capture_output=True,
                          text=True, cwd=ROOT, env=ENV | (env or {}), timeout=60)


def _usage_ok(run: subprocess.CompletedProcess) -> bool:
    return run.returncode == 0 and "acme" in json.loads(run.stdout)["usage"]


def test_the_token_file_keeps_the_token_out_of_the_process_arguments(token_file):
    """The call waits on a socket that never answers, long enough to read its arguments as any
    local user would."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        url = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
        proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli.main", "admin", "--url", url, "--token-file",
                                 str(token_file), "--timeout-s", "3", "usage"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, cwd=ROOT, env=ENV)
        try:
            time.sleep(1.5)
            cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        finally:
            proc.kill()
            proc.wait()
    assert str(token_file).encode() in cmdline, cmdline  # (the control: this is the call's own argv)
    assert ADMIN.encode() not in cmdline


def test_admin_takes_the_token_from_a_file_from_stdin_and_from_the_environment_without_a_warning(srv, token_file):
    for run in (_kvtier("admin", "--url", srv.tcp_url, "--token-file", str(token_file), "usage"),
                _kvtier("admin", "--url", srv.tcp_url, "--token", "-", "usage", stdin=ADMIN + "\n"),
                _kvtier("admin", "--url", srv.tcp_url, "usage", env={"KVTIER_ADMIN_TOKEN": ADMIN})):
        assert _usage_ok(run), run.stderr
        assert WARNING not in run.stderr


def test_a_token_given_as_an_argument_still_works_with_a_one_line_warning(srv):
    run = _kvtier("admin", "--url", srv.tcp_url, "--token", ADMIN, "usage")
    assert _usage_ok(run), run.stderr
    (line,) = run.stderr.splitlines()
    assert WARNING in line and "--token-file" in line, line


def test_a_token_file_others_may_read_or_a_link_is_refused_naming_the_fix(srv, token_file, tmp_path):
    token_file.chmod(0o644)
    run = _kvtier("admin", "--url", srv.tcp_url, "--token-file", str(token_file), "usage")
    assert run.returncode == 2 and f"chmod 600 {token_file}" in run.stderr and "Traceback" not in run.stderr
    token_file.chmod(0o600)
    link = tmp_path / "link.token"
    link.symlink_to(token_file)
    run = _kvtier("admin", "--url", srv.tcp_url, "--token-file", str(link), "usage")
    assert run.returncode == 2 and "symbolic links" in run.stderr, run.stderr  # (never followed)
    empty = tmp_path / "empty.token"
    empty.touch(mode=0o600)
    run = _kvtier("admin", "--url", srv.tcp_url, "--token-file", str(empty), "usage")
    assert run.returncode == 2 and "one line" in run.stderr, run.stderr
    run = _kvtier("admin", "--url", srv.tcp_url, "usage")
    assert run.returncode == 2 and "--token-file" in run.stderr, run.stderr  # no token at all


def test_a_wrong_token_from_a_file_is_refused_by_the_server(srv, tmp_path):
    wrong = tmp_path / "wrong.token"
    wrong.write_text("wrong\n")
    wrong.chmod(0o600)
    run = _kvtier("admin", "--url", srv.tcp_url, "--token-file", str(wrong), "usage")
    assert run.returncode == 1 and "refused" in run.stderr, run.stderr


def test_hash_token_reads_stdin_and_warns_of_a_token_given_as_an_argument():
    run = _kvtier("admin", "hash-token", stdin="abc\n")
    assert run.returncode == 0 and run.stdout.strip() == hash_token("abc") and not run.stderr, run.stderr
    run = _kvtier("admin", "hash-token", "abc")
    assert run.returncode == 0 and run.stdout.strip() == hash_token("abc")
    (line,) = run.stderr.splitlines()
    assert WARNING in line and "stdin" in line, line


def test_top_takes_the_token_from_a_file_for_the_per_tenant_series(srv, token_file):
    """The admin token on the loopback metrics address shows the tenants; without it, none."""
    address = srv.info["metrics"]
    with_file = _kvtier("top", "--server", address, "--token-file", str(token_file), "--once")
    from_stdin = _kvtier("top", "--server", address, "--token", "-", "--once", stdin=ADMIN + "\n")
    without = _kvtier("top", "--server", address, "--once")
    in_argv = _kvtier("top", "--server", address, "--token", ADMIN, "--once")
    for run in (with_file, from_stdin, without, in_argv):
        assert run.returncode == 0, run.stderr
    assert all("acme" in run.stdout for run in (with_file, from_stdin, in_argv))
    assert "acme" not in without.stdout  # (the control: the tenants need the token)
    assert [WARNING in run.stderr for run in (with_file, from_stdin, without, in_argv)] == [False, False, False, True]


def test_token_from_stdin_with_no_token_there_is_a_usage_error_for_top_and_admin(srv):
    """A secret pipe that failed (``vault … | kvtier top --token -``), or a closed stdin: exit 2 and
    why, not a run without the token nor one with the environment's in its place."""
    env = {"KVTIER_ADMIN_TOKEN": ADMIN, "KVTIER_METRICS_TOKEN": ADMIN}  # (never taken instead)
    said = "--token -: stdin held no token"
    for stdin in ("", "\n", "  \n" + ADMIN + "\n"):
        top = _kvtier("top", "--server", srv.info["metrics"], "--token", "-", "--once", stdin=stdin, env=env)
        admin = _kvtier("admin", "--url", srv.tcp_url, "--token", "-", "usage", stdin=stdin, env=env)
        for run in (top, admin):
            assert run.returncode == 2 and said in run.stderr and "Traceback" not in run.stderr, (stdin, run)
        assert "acme" not in top.stdout and not admin.stdout
