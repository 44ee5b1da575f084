"""The connector's store is flushed when its process ends without vLLM's shutdown: SIGTERM
(default action) and plain interpreter exit; a SIGTERM during a close's flush waits for it; one
store's failed close does not skip the others. A real subprocess, a real disk tier; no vLLM."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from kvtier.core.layout import KVLayout
from kvtier.store.config import StoreConfig, build_store

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32", block_tokens=64)
BLOCKS = 24

CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    import numpy as np
    from kvtier.core.keys import BlockKey
    from kvtier.core.layout import KVLayout
    from kvtier.integrations.vllm import shared_store
    from kvtier.store.config import StoreConfig

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32", block_tokens=64)
    store = shared_store.acquire(StoreConfig(host_bytes="64MiB", disk_path=sys.argv[1], encrypt=False), layout,
                                 flush_timeout_s=10)
    keys = [BlockKey(bytes([i]) * 32) for i in range({blocks})]
    blocks = [np.full(layout.block_nbytes, i, dtype=np.uint8) for i in range({blocks})]
    store.put(keys, blocks)
    if sys.argv[2] == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the handler raises SystemExit before this ends
    print("exiting", flush=True)
    """
).replace("{blocks}", str(BLOCKS))


@pytest.mark.parametrize("how", ["sigterm", "exit"])
def test_a_process_that_ends_without_vllms_shutdown_still_flushes_its_store(tmp_path, how):
    disk = tmp_path / "disk"
    done = subprocess.run([sys.executable, "-c", CHILD, str(disk), how], capture_output=True, text=True, timeout=120)
    assert done.returncode == (128 + signal.SIGTERM if how == "sigterm" else 0), done.stderr[-2000:]
    store = build_store(StoreConfig(host_bytes=0, disk_path=str(disk), encrypt=False), LAYOUT)
    try:
        from kvtier.core.keys import BlockKey

        keys = [BlockKey(bytes([i]) * 32) for i in range(BLOCKS)]
        assert store.lookup(keys).hit_blocks == BLOCKS, "every block only DRAM held reached the disk"
    finally:
        store.close()


# A disk that takes a while per batch (a busy NVMe, a network mount): the flush is under way when
# the signal comes, and well within its 10 s bound.
SLOW_DISK = """
import os, signal, sys, threading, time
import numpy as np
from kvtier.core.keys import BlockKey
from kvtier.core.layout import KVLayout
from kvtier.integrations.vllm import shared_store
from kvtier.store.config import StoreConfig
from kvtier.tiers.disk import DiskTier

slow_put_many = DiskTier.put_many
def put_many(self, *a, **kw):
    time.sleep(0.8)
    return slow_put_many(self, *a, **kw)
DiskTier.put_many = put_many

layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32", block_tokens=64)
def filled(disk):
    store = shared_store.acquire(StoreConfig(host_bytes="64MiB", disk_path=disk, encrypt=False), layout,
                                 flush_timeout_s=10)
    store.put([BlockKey(bytes([i]) * 32) for i in range({blocks})],
              [np.full(layout.block_nbytes, i, dtype=np.uint8) for i in range({blocks})])
    return store
def sigterm_in(seconds):
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGTERM))
    timer.daemon = True
    timer.start()
""".replace("{blocks}", str(BLOCKS))

DURING_RELEASE = SLOW_DISK + """
store = filled(sys.argv[1])
# the engine shuts down (an LLM deleted at the end of a script): the store is released and
# flushes; a SIGTERM (docker stop, `timeout`, systemd) lands meanwhile, or not (control)
if sys.argv[2] == "sigterm":
    sigterm_in(0.3)
shared_store.release(store)
print("released", flush=True)
"""

DURING_EXIT = SLOW_DISK + """
filled(sys.argv[1])
sigterm_in(0.3)   # lands in the atexit hook's flush
print("exiting", flush=True)
"""

TWO_STORES = SLOW_DISK + """
first, second = filled(sys.argv[1]), filled(sys.argv[2])
def interrupted(*a, **kw):
    raise KeyboardInterrupt   # a Ctrl-C, another handler's SystemExit: no Exception
first.close = interrupted
print("exiting", flush=True)
"""


def _on_disk(disk) -> int:
    from kvtier.core.keys import BlockKey

    store = build_store(StoreConfig(host_bytes=0, disk_path=str(disk), encrypt=False), LAYOUT)
    try:
        return store.lookup([BlockKey(bytes([i]) * 32) for i in range(BLOCKS)]).hit_blocks
    finally:
        store.close()


@pytest.mark.parametrize("how", ["sigterm", "none"])
def test_a_sigterm_during_the_stores_flush_lets_the_bounded_flush_finish(tmp_path, how):
    """The engine's shutdown releases the store, whose close flushes the blocks only DRAM holds
    (~1 s here, 10 s allowed); a SIGTERM then used to raise SystemExit inside the flush's wait:
    the flush was abandoned, the store was out of the registry (no atexit flush) and its daemon
    flusher died with the interpreter, so 0 of 24 blocks reached the disk. Now the exit waits for
    the flush and the status still says SIGTERM (143, as a SIGTERM at any other time). Control
    (no SIGTERM): every block flushed, the script goes on, status 0."""
    disk = tmp_path / "disk"
    done = subprocess.run([sys.executable, "-c", DURING_RELEASE, str(disk), how], capture_output=True, text=True,
                          timeout=60)
    assert _on_disk(disk) == BLOCKS, "blocks only DRAM held were lost\n" + done.stderr[-2000:]
    if how == "sigterm":
        assert done.returncode == 128 + signal.SIGTERM and "released" not in done.stdout, done.stderr[-2000:]
        assert "SIGTERM during the store's bounded flush" in done.stderr, done.stderr[-2000:]
    else:
        assert done.returncode == 0 and "released" in done.stdout, done.stderr[-2000:]


def test_a_sigterm_during_the_exit_hooks_flush_lets_it_finish(tmp_path):
    """A process exiting on its own flushes its store in the atexit hook; a SIGTERM then used to
    abandon that flush (SystemExit in the atexit callback). It waits for it now; the process was
    exiting already and keeps its own status."""
    disk = tmp_path / "disk"
    done = subprocess.run([sys.executable, "-c", DURING_EXIT, str(disk)], capture_output=True, text=True, timeout=60)
    assert _on_disk(disk) == BLOCKS, "blocks only DRAM held were lost\n" + done.stderr[-2000:]
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_one_stores_interrupted_close_does_not_skip_the_others(tmp_path):
    """Two stores open at exit; closing the first raises something that is no Exception: the
    second is still closed and flushed (before, the atexit hook stopped at the first)."""
    first, second = tmp_path / "first", tmp_path / "second"
    done = subprocess.run([sys.executable, "-c", TWO_STORES, str(first), str(second)], capture_output=True, text=True,
                          timeout=60)
    assert _on_disk(second) == BLOCKS, "the second store was never closed\n" + done.stderr[-2000:]
    assert "closing a store at interpreter exit was interrupted (KeyboardInterrupt)" in done.stderr, done.stderr[-2000:]
