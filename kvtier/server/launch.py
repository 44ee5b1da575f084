"""Start a ``kvtier serve`` subprocess and wait until it listens (for benchmarks and tests).

::

    with ServerProcess.start(tenants={"acme": token}) as srv:
        tier = RemoteTier(srv.url, token)

The server gets a fresh TOML config in a temporary directory (tokens are
written there hashed only), loopback addresses with OS-chosen ports, and is
stopped with SIGTERM (then SIGKILL) on exit.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from kvtier.child_process import die_with_parent
from kvtier.private_files import replace_private_file
from kvtier.server.auth import hash_token


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{json.dumps(str(k))} = {_toml_value(x)}" for k, x in v.items()) + " }"
    return json.dumps(str(v))


def write_config(path: str, server: dict, tenants: dict[str, dict], shared: list[dict] | None = None,
                 admin_token: str | None = None) -> None:
    """``tenants``: name → {"token": str or [str], "quota": …, "ttl_s": …, "read_shared": […], …}."""
    lines = ["[server]"] + [f"{k} = {_toml_value(v)}" for k, v in server.items()]
    if admin_token:
        lines += ["", "[admin]", f"token_sha256 = {_toml_value([hash_token(admin_token)])}"]
    for name, spec in tenants.items():
        spec = dict(spec)
        tokens = spec.pop("token")
        tokens = [tokens] if isinstance(tokens, str) else tokens
        lines += ["", "[[tenant]]", f"name = {_toml_value(name)}",
                  f"token_sha256 = {_toml_value([hash_token(t) for t in tokens])}"]
        lines += [f"{k} = {_toml_value(v)}" for k, v in spec.items()]
    for s in shared or []:
        lines += ["", "[[shared]]"] + [f"{k} = {_toml_value(v)}" for k, v in s.items()]
    # 0600 like every file kvtier makes: a server config may hold secrets (events keys), and the
    # server refuses such a file that others can read.
    replace_private_file(path, ("\n".join(lines) + "\n").encode())


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    info: dict
    workdir: str
    own_workdir: bool = True
    stderr_path: str = ""
    urls: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.urls[0]

    @property
    def unix_url(self) -> str | None:
        return next((u for u in self.urls if u.startswith("unix://")), None)

    @property
    def tcp_url(self) -> str | None:
        return next((u for u in self.urls if u.startswith(("tcp://", "tls://"))), None)

    @classmethod
    def start(
        cls,
        tenants: dict[str, dict | str],
        *,
        server: dict | None = None,
        shared: list[dict] | None = None,
        admin_token: str | None = None,
        unix: bool = False,
        tcp: bool = True,
        workdir: str | None = None,
        timeout_s: float = 20.0,
        env: dict | None = None,
    ) -> "ServerProcess":
        own = workdir is None
        workdir = workdir or tempfile.mkdtemp(prefix="kvtier-serve-")
        listen = []
        if tcp:
            listen.append("tcp://127.0.0.1:0")
        if unix:
            listen.append(f"unix://{workdir}/kvtier.sock")
        settings = {"listen": listen, "capacity": "256MiB", "max_block": "8MiB", **(server or {})}
        specs = {n: ({"token": s} if isinstance(s, str) else s) for n, s in tenants.items()}
        config = os.path.join(workdir, "kvtier.toml")
        write_config(config, settings, specs, shared, admin_token)
        stderr_path = os.path.join(workdir, "serve.log")
        stderr = open(stderr_path, "wb")  # noqa: SIM115 - the child owns it
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.server", "--config", config],
            stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})}, preexec_fn=die_with_parent,
        )
        stderr.close()
        line = _read_line(proc, timeout_s)
        if not line:
            proc.kill()
            proc.wait()
            log = open(stderr_path).read()[-2000:]
            raise RuntimeError(f"kvtier serve did not start (exit {proc.returncode}):\n{log}")
        info = json.loads(line)
        return cls(proc, info, workdir, own, stderr_path, list(info["listen"]))

    def log(self) -> str:
        with open(self.stderr_path, errors="replace") as f:
            return f.read()

    def stop(self, timeout_s: float = 5.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        if self.own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return self.proc.returncode

    def rss_bytes(self) -> int:
        """Resident memory of the server process (Linux)."""
        with open(f"/proc/{self.proc.pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0 or not sel.select(left):
            return ""
        chunk = os.read(proc.stdout.fileno(), 4096)
        if not chunk:
            return ""
        buf += chunk
    sel.close()
    return buf.split(b"\n", 1)[0].decode()
