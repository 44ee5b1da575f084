"""Containers on one host sharing a disk tier's directory (s31 a3 D5).

Pods with ``hostNetwork: true`` (or ``docker --network host``) share the host name but not the PID
namespace. The disk tier named its extents and temp files with the host name alone, so a process
opening the tier in another container (its restart scan) took a writer's extent, published but
its names not yet linked, or its temp file mid-write, for a dead writer's -- that pid does not
exist in the opener's namespace -- and removed it: the writer's ``put_many`` / ``put`` failed. Now
names carry :func:`kvtier.child_process.host_tag` (host name and PID namespace): a writer of
another namespace is judged by age only.

Real PID namespaces (``unshare --pid``, root only; skipped otherwise): the writer runs in one, held
at the moment in question until the opener, in another, has opened the tier.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import pytest
import xxhash

from kvtier.child_process import host_tag
from kvtier.tiers import direct_io, disk_extents
from kvtier.tiers.disk import STALE_TEMP_S

#: the writer, held where the opener could take its files for a dead writer's: ``put_many`` between
#: publishing its extent and linking the names, ``put`` while its temp file is being written
WRITER = r"""
import os, sys, time
import numpy as np
from kvtier.tiers.disk import DiskTier

root, sync, how = sys.argv[1:4]

def held(then):
    def wait(*args, **kwargs):
        open(os.path.join(sync, "held"), "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(sync, "go")) and time.monotonic() < deadline:
            time.sleep(0.02)
        return then(*args, **kwargs)
    return wait

tier = DiskTier(root, 1 << 24, direct_io=False)
blocks = [np.full(16384, i, np.uint8) for i in (1, 2)]
if how == "put_many":
    tier._link_all = held(tier._link_all)
    statuses = tier.put_many([bytes([1]) * 32, bytes([2]) * 32], blocks)
else:
    tier._io.write = held(tier._io.write)
    statuses = [tier.put(bytes([1]) * 32, blocks[0])]
print(os.getpid(), [s.name for s in statuses])
tier.check_integrity(deep=True)
"""

OPENER = "import sys; from kvtier.tiers.disk import DiskTier; DiskTier(sys.argv[1], 1 << 24, direct_io=False).close()"


def _in_own_pid_namespace(*argv: str) -> list[str]:
    """A command run as pid 3 of a PID namespace of its own (``sleep 0`` takes pid 2): a pid that
    the opener, pid 1 of another namespace, finds no process at."""
    script = " ".join(f"'{a}'" for a in argv)
    return ["unshare", "--pid", "--fork", "sh", "-c", f"sleep 0; {script}"]


@pytest.fixture
def unshare_works():
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("PID namespaces need root and unshare")
    if subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot make a PID namespace here")


@pytest.mark.parametrize("how", ["put_many", "put"])
def test_an_open_in_another_container_keeps_a_live_writers_files(tmp_path, unshare_works, how):
    root, sync = tmp_path / "tier", tmp_path / "sync"
    sync.mkdir()
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": os.pathsep.join(sys.path)}
    writer = subprocess.Popen(_in_own_pid_namespace(sys.executable, "-c", WRITER, str(root), str(sync), how),
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (sync / "held").exists():
            assert writer.poll() is None and time.monotonic() < deadline, writer.communicate()
            time.sleep(0.02)
        # pid 1 of a namespace of its own: the writer's pid 3 is no process there
        opened = subprocess.run(["unshare", "--pid", "--fork", sys.executable, "-c", OPENER, str(root)],
                                env=env, capture_output=True, text=True, timeout=60)
        assert opened.returncode == 0, opened.stderr
    finally:
        (sync / "go").touch()
    out, err = writer.communicate(timeout=60)
    assert writer.returncode == 0, err
    pid, statuses = out.split(maxsplit=1)
    assert int(pid) == 3  # a pid the opener's namespace has no process at
    assert statuses.strip() == str(["OK"] * (2 if how == "put_many" else 1)), err


def test_names_from_before_the_namespace_tag_are_judged_by_age():
    """A temp file or extent tagged with the host name alone (named before the tag held the PID
    namespace) is another host's: never its writer known dead, a temp file stale only once older
    than any write takes. Controls: the same names with this namespace's tag are a dead writer's."""
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True).stdout)
    now, host = time.time(), socket.gethostname()
    ours = host_tag()
    old_temp, our_temp = (f".{'ab' * 32}.abcd1234.{dead}.{tag}.tmp" for tag in (host, ours))
    assert not direct_io.stale_temp(old_temp, now, now, STALE_TEMP_S)
    assert direct_io.stale_temp(old_temp, now - 2 * STALE_TEMP_S, now, STALE_TEMP_S)
    assert direct_io.stale_temp(our_temp, now, now, STALE_TEMP_S)
    old_extent, our_extent = (f"{'ab' * 32}-abcd1234-{dead}-{tag}.kvx"
                              for tag in (xxhash.xxh32_hexdigest(host.encode()), ours))
    assert disk_extents.is_extent_name(old_extent) and not disk_extents.writer_gone(old_extent)
    assert disk_extents.writer_gone(our_extent)
