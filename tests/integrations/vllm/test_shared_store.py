"""The connector's store is flushed when its process ends without vLLM's shutdown: SIGTERM
(default action) and plain interpreter exit. A real subprocess, a real disk tier; no vLLM."""

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
