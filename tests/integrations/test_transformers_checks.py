"""Checks of ``KVTierLM`` against references kvtier does not compute itself.

* The recompute baseline (``KVTierLM(model, None)``) against the model's own
  forward and ``model.generate(do_sample=False)``: a bug shared by kvtier's cold
  and warm paths (its cache layer, say) would make them agree with each other.
* A load that writes nothing is caught because the KV storage is poisoned
  (NaN) before each request; shown with a load broken on purpose.
* A block corrupted in the middle of a chain, on local disk and on a server's
  spill disk: the load stops there, the rest is recomputed, outputs are those
  of the plain model.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtier.core.keys import block_keys  # noqa: E402
from kvtier.integrations.transformers import KVTierLM, namespace_for_model  # noqa: E402
from kvtier.integrations.transformers import cache_io, session  # noqa: E402
from kvtier.integrations.transformers.models import TINY_SPEC, build_model, load_model  # noqa: E402
from kvtier.store.config import StoreConfig, build_store  # noqa: E402
from kvtier.store.tiered import TieredStore  # noqa: E402
from kvtier.tiers.host import HostTier  # noqa: E402

FP32_TOL = 1e-4
BLOCK = 16
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-checks")
    build_model(TINY_SPEC, path, tokenizer=False)
    model, _ = load_model(path, tokenizer=False)
    return model


@pytest.fixture(scope="module")
def ns(tiny):
    return namespace_for_model(tiny, block_tokens=BLOCK)


def tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, TINY_SPEC.vocab_size, n)


@torch.inference_mode()
def reference(model, prompt: np.ndarray) -> tuple[torch.Tensor, list[int]]:
    """The model alone: last-position logits of one full forward, and HF's greedy generate."""
    ids = torch.from_numpy(prompt.astype(np.int64))[None]
    logits = model(input_ids=ids).logits[0, -1].float()
    out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                         pad_token_id=0)
    return logits, out[0, prompt.size:].tolist()


def assert_matches_model(gen, ref) -> None:
    logits, generated = ref
    diff = float((gen.first_logits - logits).abs().max())
    assert diff <= FP32_TOL, f"logits differ from the model's own forward by {diff}"
    assert gen.tokens == generated, "tokens differ from model.generate(do_sample=False)"


def test_the_recompute_baseline_and_a_hit_match_the_models_own_forward_and_generate(tiny, ns):
    prompt = tokens(150, seed=1)
    ref = reference(tiny, prompt)
    plain = KVTierLM(tiny, None, block_tokens=BLOCK, capacity_tokens=256)
    store = TieredStore([HostTier(64 * ns.layout.block_nbytes, ns.layout.block_nbytes)])
    cached = KVTierLM(tiny, store, ns, capacity_tokens=256)
    try:
        assert_matches_model(plain.generate(prompt, NEW_TOKENS), ref)
        cold = cached.generate(prompt, NEW_TOKENS)
        assert cold.cached_tokens == 0
        assert_matches_model(cold, ref)
        cached.wait_saves()
        warm = cached.generate(prompt, NEW_TOKENS)
        assert warm.cached_tokens == 144
        assert_matches_model(warm, ref)
    finally:
        plain.close()
        cached.close()
        store.close()


def _load_that_writes_nothing(store, keys, storage, staging=None):
    """A broken load: reads and verifies the blocks, copies them into a throwaway storage,
    and reports them loaded into the real one."""
    scratch = cache_io.KVStorage(storage.layout, storage.capacity, storage.dtype, poison=False)
    return cache_io.load_blocks(store, keys, scratch, staging)


@pytest.mark.parametrize("poison", [True, False])
def test_poisoned_storage_catches_a_load_that_writes_nothing(tiny, ns, monkeypatch, poison):
    prompt = tokens(100, seed=2)
    ref = reference(tiny, prompt)
    store = TieredStore([HostTier(64 * ns.layout.block_nbytes, ns.layout.block_nbytes)])
    lm = KVTierLM(tiny, store, ns, capacity_tokens=256, poison=poison)
    try:
        lm.generate(prompt, 2)  # computes the prompt into the storage, saves its blocks
        lm.wait_saves()
        monkeypatch.setattr(session, "load_blocks", _load_that_writes_nothing)
        broken = lm.generate(prompt, NEW_TOKENS, save=False)
        assert broken.cached_tokens == 96, "the broken load claims every full block"
        if poison:
            assert torch.isnan(broken.first_logits).all(), "the skipped copy must surface as NaN"
            with pytest.raises(AssertionError):
                assert_matches_model(broken, ref)
        else:
            # The blind spot poisoning closes: the storage still holds this prompt's KV
            # from the request before, so a load that copies nothing passes for a good one.
            assert_matches_model(broken, ref)
    finally:
        lm.close()
        store.close()


def _flip_byte(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))


def test_a_block_corrupted_on_disk_mid_chain_stops_the_load_there(tiny, ns, tmp_path):
    prompt = tokens(6 * BLOCK + 5, seed=3)
    ref = reference(tiny, prompt)
    config = StoreConfig(host_bytes="1MiB", disk_path=str(tmp_path / "disk"), disk_bytes="64MiB",
                         write_mode="write-through", encrypt=False)
    writer_store = build_store(config, ns.layout)
    writer = KVTierLM(tiny, writer_store, ns, capacity_tokens=256)
    writer.generate(prompt, 2)
    assert len(writer.wait_saves()) == 6
    writer.close()
    writer_store.close()

    k = 3
    store = build_store(config.replace(host_bytes=0), ns.layout)  # disk only: every read is verified there
    disk = store.tier("disk")
    key = block_keys(ns, prompt)[k]
    path, base = disk.locate(key)  # its own file, or its place in a packed extent
    _flip_byte(path, base + 4096 + 100)  # inside block k's payload (after its header page)
    lm = KVTierLM(tiny, store, ns, capacity_tokens=256)
    try:
        warm = lm.generate(prompt, NEW_TOKENS, save=False)
        assert warm.cached_tokens == k * BLOCK, "blocks 0..k-1 load, block k and after are recomputed"
        assert warm.loaded_bytes == {"disk": k * ns.layout.block_nbytes}
        assert_matches_model(warm, ref)
        assert disk.stats.snapshot()["verify_failures"] == 1
        assert not disk.contains(key), "a corrupt block is dropped, never served"
    finally:
        lm.close()
        store.close()


TOKEN = "checks-token"


def _spilled(spill, payload: bytes) -> list:
    """(file, offset) of each published spill file under ``spill`` holding ``payload``."""
    hits = []
    for path in spill.rglob("*"):
        if path.name.endswith(".tmp") or not path.is_file():
            continue
        try:
            data = path.read_bytes()
        except FileNotFoundError:   # (renamed or dropped meanwhile)
            continue
        if payload in data:
            hits.append((path, data.find(payload)))
    return hits


def test_a_block_tampered_on_a_servers_disk_mid_chain_stops_the_load_there(tiny, ns, tmp_path):
    from kvtier.integrations.transformers.cache_io import gather_blocks
    from kvtier.server.launch import ServerProcess

    nbytes = ns.layout.block_nbytes  # 4 KiB
    n_blocks, k = 40, 5
    prompt = tokens(n_blocks * BLOCK + 3, seed=4)
    ref = reference(tiny, prompt)
    spill = tmp_path / "server-disk"
    # A pool of 16 blocks: the early blocks of a 40-block chain are evicted to the spill disk.
    server = ServerProcess.start({"acme": TOKEN}, server={
        "capacity": 16 * 8192, "max_block": 8192, "disk_dir": str(spill), "disk_capacity": "64MiB"})
    config = StoreConfig(host_bytes=0, remote_url=server.url, remote_token=TOKEN, encrypt=False)
    try:
        writer_store = build_store(config, ns.layout)
        writer = KVTierLM(tiny, writer_store, ns, capacity_tokens=1024)
        writer.generate(prompt, 2)
        assert len(writer.wait_saves()) == n_blocks
        payload = bytes(gather_blocks(writer.storage, k, 1)[0])  # what the server holds for block k
        writer.close()
        writer_store.close()

        # Find block k in the server's spill files by its bytes (their names are the server's business).
        # The server spills on its I/O threads after answering the PUTs: look until it has (a file
        # being written, or renamed from its temporary name, is looked at again next time).
        hits = _spilled(spill, payload)
        deadline = time.monotonic() + 30
        while len(hits) != 1 and time.monotonic() < deadline:
            time.sleep(0.1)
            hits = _spilled(spill, payload)
        assert len(hits) == 1, f"block {k} should be spilled to the server's disk once, found {len(hits)}"
        path, offset = hits[0]
        _flip_byte(path, offset + nbytes // 2)

        store = build_store(config, ns.layout)
        lm = KVTierLM(tiny, store, ns, capacity_tokens=1024)
        warm = lm.generate(prompt, NEW_TOKENS, save=False)
        assert warm.cached_tokens == k * BLOCK, "blocks 0..k-1 load, block k and after are recomputed"
        assert_matches_model(warm, ref)
        lm.close()
        store.close()
    finally:
        server.stop()
