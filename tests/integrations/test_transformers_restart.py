"""A second process serves the first process's contexts warm, from the disk tier.

Process 1 (a subprocess) generates with kvtier, saving write-through to a disk
tier, and exits. This test process then opens a fresh store on the same
directory — empty host tier — and must load the whole cached prefix from disk
and produce exactly what a recompute produces.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtier.integrations.transformers import KVTierLM, namespace_for_model  # noqa: E402
from kvtier.integrations.transformers.models import TINY_SPEC, build_model, load_model  # noqa: E402
from kvtier.store.config import StoreConfig, build_store  # noqa: E402

BLOCK = 16
PROMPT = np.random.default_rng(42).integers(0, TINY_SPEC.vocab_size, 300)

FIRST_PROCESS = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from kvtier.integrations.transformers import KVTierLM
    from kvtier.integrations.transformers.models import load_model
    from kvtier.integrations.transformers.namespace import namespace_for_model
    from kvtier.store.config import StoreConfig, build_store

    model_dir, store_dir, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    model, _ = load_model(model_dir, tokenizer=False)
    ns = namespace_for_model(model, block_tokens=16)
    store = build_store(StoreConfig(host_bytes="64MiB", disk_path=store_dir, disk_bytes="1GiB",
                                    write_mode="write-through", encrypt=False), ns.layout)
    lm = KVTierLM(model, store, ns)
    out = lm.generate(np.asarray(prompt), 6)
    statuses = lm.wait_saves()
    lm.close()
    store.close()
    print(json.dumps({"tokens": out.tokens, "saved": len(statuses), "pid": __import__("os").getpid()}))
    """
)


def store_config(path) -> StoreConfig:
    return StoreConfig(host_bytes="64MiB", disk_path=str(path), disk_bytes="1GiB",
                       write_mode="write-through", encrypt=False)


def test_second_process_loads_the_first_ones_context_from_disk(tmp_path):
    model_dir, store_dir = tmp_path / "model", tmp_path / "store"
    build_model(TINY_SPEC, model_dir, tokenizer=False)
    done = subprocess.run(
        [sys.executable, "-c", FIRST_PROCESS, str(model_dir), str(store_dir), json.dumps(PROMPT.tolist())],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    first = json.loads(done.stdout.strip().splitlines()[-1])
    # 300 prompt + 5 fed generated tokens = 19 full blocks of 16
    assert first["saved"] == 19

    model, _ = load_model(model_dir, tokenizer=False)
    ns = namespace_for_model(model, block_tokens=BLOCK)
    store = build_store(store_config(store_dir), ns.layout)
    assert store.tier("host").used_bytes == 0
    lm = KVTierLM(model, store, ns)
    plain = KVTierLM(model, None, block_tokens=BLOCK)
    warm = lm.generate(PROMPT, 6, save=False)
    cold = plain.generate(PROMPT, 6)
    assert warm.cached_tokens == 18 * BLOCK  # every full block of the prompt
    assert set(warm.loaded_bytes) == {"disk"}
    assert float((warm.first_logits - cold.first_logits).abs().max()) <= 1e-4
    assert warm.tokens == cold.tokens == first["tokens"]
    # The blocks were promoted on the way: the next request loads them from DRAM.
    again = lm.generate(PROMPT, 2, save=False)
    assert set(again.loaded_bytes) == {"host"}
    lm.close()
    plain.close()
    store.check_integrity()
    store.close()
