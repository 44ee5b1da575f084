"""The core store must import and work where torch (and transformers, vLLM) are absent."""

import subprocess
import sys

CODE = """
import sys
for name in ("torch", "transformers", "vllm"):
    sys.modules[name] = None  # any import of them now raises ImportError
import numpy as np
import kvtier
from kvtier.store.tiered import TieredStore
from kvtier.store.context import ContextCache
from kvtier.tiers.host import HostTier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.encrypted import EncryptedTier
from kvtier.cli.main import build_parser
lay = kvtier.KVLayout(2, 2, 8, "float16", 4)
store = TieredStore([HostTier(4 * lay.block_nbytes, lay.block_nbytes)])
cache = ContextCache(store, kvtier.Namespace("m", lay))
keys = cache.keys(list(range(8)))
cache.save(keys, [np.ones(lay.block_shape, np.float16)] * 2)
assert cache.lookup(list(range(8))).hit_blocks == 2
build_parser()  # every command registers without importing heavy packages
print("ok")
"""


def test_core_imports_and_runs_without_torch():
    result = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
