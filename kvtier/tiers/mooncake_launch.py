"""Start a Mooncake Store cluster on one machine: a master and N segment holders.

For trying Mooncake out (``kvtier mooncake up``), benchmarks and tests. A *holder*
is a process that contributes ``segment_bytes`` of its memory to the store and
must stay alive while anything is stored there; the master keeps metadata and
leases (and, with its built-in HTTP metadata server, the transfer engine's
address book)::

    with MooncakeCluster.start(holders=2) as cluster:
        tier = MooncakeTier(cluster.master_address, cluster.metadata_url, tenant="acme", secret=...)

Everything binds to loopback (``MC_TCP_BIND_ADDRESS=127.0.0.1``: otherwise the
transfer engine advertises the first interface's address). Each process runs in a
process group of its own so that tests can SIGKILL / SIGSTOP one and restart it.
The holder side runs as ``python -m kvtier.tiers.mooncake_launch holder …``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.child_process import die_with_parent

LOOPBACK = "127.0.0.1"
MASTER_BINARY = "mooncake_master"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def find_master_binary() -> str:
    """``mooncake_master`` beside this interpreter (a venv's bin/) or on PATH."""
    beside = Path(sys.executable).parent / MASTER_BINARY
    if beside.exists():
        return str(beside)
    found = shutil.which(MASTER_BINARY)
    if not found:
        raise FileNotFoundError(
            "mooncake_master not found: pip install 'kvtier[mooncake]' (mooncake-transfer-engine-non-cuda) "
            "and apt-get install libibverbs1 ibverbs-providers")
    return found


def client_env() -> dict[str, str]:
    """The environment a Mooncake client on this machine needs (loopback transfer address)."""
    env = dict(os.environ)
    env.setdefault("MC_TCP_BIND_ADDRESS", LOOPBACK)
    return env


def _wait_port(port: int, proc: subprocess.Popen, timeout_s: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {_tail(log)}")
        try:
            with socket.create_connection((LOOPBACK, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{what} did not listen on {LOOPBACK}:{port} within {timeout_s} s: {_tail(log)}")


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def _wait_stopped(pid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        states = []
        for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
            try:
                states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
            except (OSError, IndexError):
                pass  # a thread that just ended
        if not Path("/proc").is_dir() or (states and all(s in "Tt" for s in states)):
            return  # no /proc: nothing to wait on
        if time.monotonic() >= deadline:
            raise TimeoutError(f"process {pid} did not stop within {timeout_s} s: thread states {states}")
        time.sleep(0.01)


def _stop(proc: subprocess.Popen | None, grace_s: float = 3.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGCONT)  # a frozen one cannot act on SIGTERM
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


@dataclass
class MooncakeCluster:
    """A master and its holders on loopback; every process killable and restartable on its own."""

    workdir: Path
    rpc_port: int
    http_port: int
    metrics_port: int
    segment_bytes: int
    master_flags: list[str] = field(default_factory=list)
    master: subprocess.Popen | None = None
    holders: list[subprocess.Popen | None] = field(default_factory=list)
    own_workdir: bool = True

    @property
    def master_address(self) -> str:
        return f"{LOOPBACK}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{LOOPBACK}:{self.http_port}/metadata"

    @classmethod
    def start(cls, holders: int = 2, segment_bytes: int = 256 << 20, *, workdir: str | None = None,
              master_flags: list[str] | None = None, timeout_s: float = 30.0) -> "MooncakeCluster":
        own = workdir is None
        cluster = cls(Path(workdir or tempfile.mkdtemp(prefix="kvtier-mooncake-")), free_port(), free_port(),
                      free_port(), segment_bytes, list(master_flags or []), own_workdir=own)
        try:
            cluster.start_master(timeout_s)
            for _ in range(holders):
                cluster.holders.append(None)
                cluster.start_holder(len(cluster.holders) - 1, timeout_s)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def start_master(self, timeout_s: float = 30.0) -> None:
        log = self.workdir / "master.log"
        cmd = [find_master_binary(), f"--rpc_address={LOOPBACK}", f"--rpc_port={self.rpc_port}",
               "--enable_http_metadata_server=true", f"--http_metadata_server_host={LOOPBACK}",
               f"--http_metadata_server_port={self.http_port}", f"--metrics_host={LOOPBACK}",
               f"--metrics_port={self.metrics_port}", *self.master_flags]
        with open(log, "ab") as out:
            self.master = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent,
                                           cwd=self.workdir, env=client_env())
        _wait_port(self.rpc_port, self.master, timeout_s, "mooncake_master", log)
        _wait_port(self.http_port, self.master, timeout_s, "mooncake_master's metadata server", log)

    def start_holder(self, i: int, timeout_s: float = 30.0) -> None:
        """(Re)start holder ``i``; returns once its segment is mounted."""
        ready = self.workdir / f"holder{i}.ready"
        ready.unlink(missing_ok=True)
        log = self.workdir / f"holder{i}.log"
        cmd = [sys.executable, "-m", "kvtier.tiers.mooncake_launch", "holder", "--master", self.master_address,
               "--metadata", self.metadata_url, "--segment-bytes", str(self.segment_bytes),
               "--ready-file", str(ready)]
        with open(log, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent,
                                    cwd=self.workdir, env=client_env())
        self.holders[i] = proc
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"mooncake holder {i} exited with {proc.returncode}: {_tail(log)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"mooncake holder {i} did not mount its segment in {timeout_s} s: {_tail(log)}")
            time.sleep(0.05)

    def signal_holder(self, i: int, sig: int, timeout_s: float = 5.0) -> None:
        """Send ``sig`` to holder ``i``; a SIGSTOP returns once every thread of it has stopped
        (SIGSTOP acts as each thread is next scheduled: on a loaded box, after the caller's next
        call may have been served -- a fault test would then test nothing)."""
        pid = self.holders[i].pid
        os.killpg(pid, sig)
        if sig == signal.SIGSTOP:
            _wait_stopped(pid, timeout_s)

    def kill_holder(self, i: int) -> None:
        proc = self.holders[i]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def kill_master(self) -> None:
        os.killpg(self.master.pid, signal.SIGKILL)
        self.master.wait()

    def alive_holders(self) -> int:
        return sum(1 for p in self.holders if p is not None and p.poll() is None)

    def stop(self) -> None:
        for proc in self.holders:
            _stop(proc)
        _stop(self.master)
        if self.own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "MooncakeCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# -- the holder process ----------------------------------------------------------------------
def run_holder(master: str, metadata: str, segment_bytes: int, ready_file: str | None,
               hostname: str = LOOPBACK) -> int:
    """Contribute ``segment_bytes`` to the store and stay alive until SIGTERM/SIGINT."""
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", LOOPBACK)
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(hostname, metadata, segment_bytes, 16 << 20, "tcp", "", master, None)
    if rc != 0:
        print(f"mooncake holder: setup returned {rc}", file=sys.stderr, flush=True)
        return 1
    stop = False

    def on_signal(*_):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if ready_file:
        Path(ready_file).write_text(str(os.getpid()))
    print(f"mooncake holder: {segment_bytes} bytes mounted at master {master}", flush=True)
    while not stop:
        time.sleep(0.2)
    store.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier.tiers.mooncake_launch")
    sub = parser.add_subparsers(dest="role", required=True)
    h = sub.add_parser("holder", help="contribute a memory segment to a Mooncake Store")
    h.add_argument("--master", required=True, help="the master's RPC address, host:port")
    h.add_argument("--metadata", required=True, help="metadata server URL (http://host:port/metadata)")
    h.add_argument("--segment-bytes", type=int, required=True)
    h.add_argument("--hostname", default=LOOPBACK, help="the address other processes reach this holder at")
    h.add_argument("--ready-file")
    args = parser.parse_args(argv)
    return run_holder(args.master, args.metadata, args.segment_bytes, args.ready_file, args.hostname)


if __name__ == "__main__":
    sys.exit(main())
