"""A LoRA request is keyed by the adapter version vLLM computes it with, and never saved where that
version is not known.

* vLLM reads an adapter's files only when it loads its ``lora_int_id`` (or at every step with
  ``load_inplace``): files replaced under a loaded id are computed with the old weights, so such a
  request is neither served nor saved.
* A request whose adapter could not be named still computes into vLLM's prefix cache under the
  adapter's name and path: pages of an unknown version, which no later request served them saves.
* An adapter's files are hashed as the very files their identities name (a link to the directory
  flipped and flipped back while they are read cannot pass one version off as another), a file
  being written fails at its first chunk, and a directory whose files are changing is not read
  again at once.
* A change of the files' identity alone (a ``chmod``) is no new version.
* Files caught being written (the same bytes copied over themselves) refuse only the requests that
  see them: the id keeps its version, unless another one stood ``SETTLED_S`` (vLLM may have loaded
  it at an eviction).
* A P/D prefill whose adapter changed while its saves were in flight announces no blocks; one whose
  adapter's files changed identity alone between a step's build and its save stores every block
  it announces: a ``chmod`` keeps the step's saves, files written again (a ``touch``, the same
  bytes, another version and back within the step) drop them, and the scheduler announces none
  of them and saves nothing more of the request (planned again from the same pages, they stored
  the other version's KV under this one's keys).
* The bound on the ids remembered never drops the id being named (a KeyError there killed vLLM's
  scheduler thread, and so the engine).
* A copy of an id's own bytes over its files that takes longer than ``SETTLED_S`` in all, no state
  of which stood that long, leaves the id its version; one state that stood that long does not,
  however often a ``chmod`` moved its ctime.
* An id first named from young files keeps that version: vLLM may hold it (whole files, loaded
  however young) or the one its server registered (an upload over it caught part way).

Scheduler side and one worker, without an engine: the adapter files are real files (their
contents only hashed here); vLLM's rule for reading them is stated in each test.
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
import tracemalloc

import pytest

from tests.integrations.vllm.harness import skip_without_vllm

skip_without_vllm()

from kvtier.core.layout import KVLayout  # noqa: E402
from kvtier.core.namespace import Namespace  # noqa: E402
from kvtier.integrations.transformers import weights_hash  # noqa: E402
from kvtier.integrations.vllm import lora_digest  # noqa: E402
from kvtier.integrations.vllm.config import ConnectorConfig, EngineKV  # noqa: E402
from kvtier.integrations.vllm.lora_digest import AdapterKeys  # noqa: E402
from kvtier.integrations.vllm.scheduler_side import SchedulerSide  # noqa: E402
from kvtier.store.config import StoreConfig, build_store  # noqa: E402
from tests.integrations.vllm.test_lora_keys import _new, _next_chunk, _request  # noqa: E402
from tests.integrations.vllm.test_worker_saves import filled_worker  # noqa: E402

PAGE, BLOCK = 32, 64
SETTINGS = {"lora_dtype": "float32", "max_lora_rank": 8}
LOG = "kvtier.integrations.vllm.lora_digest"


@pytest.fixture
def engine() -> EngineKV:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32", block_tokens=BLOCK)
    return EngineKV(Namespace("m", layout), page_tokens=PAGE, hash_tokens=PAGE, num_layers=2, format_tag="test")


def _lora(name: str, lora_id: int, path, **kw):
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, lora_id, str(path), **kw)


def _write_adapter(path, version: bytes, size: int = 64 << 10) -> str:
    """An adapter's files as vLLM reads them, written in place (same inodes: a retrain job's output)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        f.write('{"r": 8, "lora_alpha": 16}')
    with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
        f.write((version * size)[:size])
    return str(path)


def _scheduler(engine, adapters: AdapterKeys, lookup=lambda keys: 0, **config) -> SchedulerSide:
    return SchedulerSide(ConnectorConfig(block_tokens=BLOCK, **config), engine, lookup, loads=True, saves=True,
                         adapters=adapters)


def _run(sched: SchedulerSide, req_id: str, lora, local_tokens: int = 0) -> list:
    """A 320-token request of ``lora`` whose first ``local_tokens`` vLLM's prefix cache served, run in
    one step to its end: its save jobs."""
    request = _request(req_id, 320, lora)
    sched.num_new_matched_tokens(request, local_tokens)
    saves = sched.build(_new(req_id, list(range(10, 20)), local_tokens, 320 - local_tokens)).saves
    sched.finished(request)
    return saves


def _blocks(saves: list) -> int:
    return sum(len(job.blocks) for job in saves)


# -- vLLM computes an id's requests with the version it loaded under it ------------------------------
def test_files_replaced_under_a_loaded_id_are_neither_looked_up_nor_saved_until_vllm_reads_them(
        engine, tmp_path, caplog):
    """vLLM's worker reads an adapter's files for an id it has not loaded, or with ``load_inplace``
    (``WorkerLoRAManager.add_adapter``); a server keeps one id per adapter (``--lora-modules``,
    ``/v1/load_lora_adapter``). Retrained in place, the old weights still compute the id's requests:
    saved under the new files' keys, they would be served to the new version after a restart."""
    looked_up: list = []
    adapters = AdapterKeys(SETTINGS)
    sched = _scheduler(engine, adapters, lambda keys: looked_up.append(keys) or 0)
    path = _write_adapter(tmp_path / "customer-x", b"v1")
    v1 = adapters.of(_lora("x", 1, path))
    assert {job.adapter for job in _run(sched, "a", _lora("x", 1, path))} == {v1}, "control: v1 saved"
    looked_up.clear()

    _write_adapter(path, b"v2")                      # retrained in place; vLLM still holds v1 under id 1
    v2 = adapters.of(_lora("x", 1, path))
    with caplog.at_level(logging.WARNING, logger=LOG):
        assert _run(sched, "b", _lora("x", 1, path)) == [], "KV computed with v1 saved under v2's keys"
        assert _run(sched, "c", _lora("x", 1, path)) == []
    assert looked_up == [], "nor looked up: v2's stored KV is not what vLLM computes with"
    assert sum("not those vLLM loaded under its id 1" in r.getMessage() for r in caplog.records) == 1

    # vLLM reads the files again: with load_inplace, or under an id it has not loaded
    assert {job.adapter for job in _run(sched, "d", _lora("x", 1, path, load_inplace=True))} == {v2}
    assert {job.adapter for job in _run(sched, "e", _lora("x", 1, path))} == {v2}, "id 1 holds v2 now"
    assert {job.adapter for job in _run(sched, "f", _lora("x", 2, path))} == {v2}
    # a rollback under id 2 without load_inplace: vLLM still holds v2 there
    _write_adapter(path, b"v1")
    assert _run(sched, "g", _lora("x", 2, path)) == []


def test_the_versions_remembered_per_id_are_bounded(engine, tmp_path, monkeypatch):
    """An id forgotten here was evicted from vLLM's adapter LRU long before (``max_cpu_loras``
    adapters at most): vLLM reads its files again at its next request, so they name it again."""
    monkeypatch.setattr(lora_digest, "MAX_LOADED_IDS", 2)
    adapters = AdapterKeys(SETTINGS)
    path = _write_adapter(tmp_path / "x", b"v1")
    for lora_id in (1, 2, 3):
        assert adapters.for_request(_lora("x", lora_id, path)).key
    _write_adapter(path, b"v2")
    assert adapters.for_request(_lora("x", 3, path)).key is None, "id 3 is remembered: vLLM holds v1"
    assert adapters.for_request(_lora("x", 1, path)).key == adapters.of(_lora("x", 1, path)), \
        "id 1 was forgotten: named by its files again"


# -- requests that could not be named still compute into vLLM's prefix cache ---------------------------
def test_pages_computed_by_a_request_whose_adapter_could_not_be_named_are_never_saved_by_another(
        engine, tmp_path):
    """A request arriving while its adapter's files are rewritten cannot be named, yet vLLM computes
    it (with the weights it holds under its id) into its prefix cache under the adapter's name and
    path. A request of the new version that vLLM serves those pages must not save them under the
    new version's keys, until vLLM's prefix cache is reset."""
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=PAGE)
    adapters = AdapterKeys(SETTINGS)
    adapters.watch_prefix_cache(pool)
    sched = _scheduler(engine, adapters)
    path = _write_adapter(tmp_path / "customer-x", b"v1")
    assert _blocks(_run(sched, "a", _lora("x", 1, path))) == 5
    assert pool.reset_prefix_cache()                 # an earlier reset: vLLM's cache knows no version now
    os.remove(os.path.join(path, "adapter_model.safetensors"))   # the upload of v2 starts
    assert _run(sched, "during-upload", _lora("x", 1, path)) == []
    _write_adapter(path, b"v2")                      # uploaded; loaded in place; the reset not sent yet
    v2_served_its_pages = _run(sched, "v2", _lora("x", 1, path, load_inplace=True), local_tokens=64)
    assert v2_served_its_pages == [], "v1's pages from vLLM's prefix cache saved under v2's keys"
    assert _blocks(_run(sched, "v2-computed", _lora("x", 1, path, load_inplace=True))) == 5, \
        "control: a request vLLM served nothing computes v2 alone"
    assert pool.reset_prefix_cache()
    assert _blocks(_run(sched, "v2-after-reset", _lora("x", 1, path, load_inplace=True), local_tokens=64)) == 5


# -- reading the files -----------------------------------------------------------------------------------
def _point(link: str, target: str) -> None:
    os.symlink(target, link + ".new")
    os.replace(link + ".new", link)


def test_a_link_flipped_to_other_files_and_back_while_they_are_hashed_names_the_files_it_leads_to(
        tmp_path, monkeypatch):
    """``cur -> v2`` flipped to v1 and back within the hash (a rollback and a redeploy): the files
    read must be those whose identities the digest is remembered under, or v2's files are keyed as
    v1 for as long as they stay."""
    cur = str(tmp_path / "cur")
    v1 = _write_adapter(tmp_path / "v1", b"one")
    v2 = _write_adapter(tmp_path / "v2", b"two")
    _point(cur, v1)
    key_v1 = AdapterKeys(SETTINGS).of(_lora("x", 1, cur))
    _point(cur, v2)
    key_v2 = AdapterKeys(SETTINGS).of(_lora("x", 1, cur))
    assert key_v1 != key_v2

    hash_chunk = weights_hash._hash_chunk
    chunks_read = []

    def flip_while_read(fd, offset, nbytes):   # the operator's flips land while the files are read
        if not chunks_read:
            _point(cur, v1)
        chunks_read.append(offset)
        digest = hash_chunk(fd, offset, nbytes)
        if len(chunks_read) == 2:
            _point(cur, v2)
        return digest

    monkeypatch.setattr(weights_hash, "_hash_chunk", flip_while_read)
    adapters = AdapterKeys(SETTINGS)
    first = adapters.of(_lora("x", 1, cur))
    monkeypatch.setattr(weights_hash, "_hash_chunk", hash_chunk)
    assert len(chunks_read) >= 2, "the flips landed inside the hash"
    assert os.path.realpath(cur) == v2
    assert first in (None, key_v2)
    assert [adapters.of(_lora("x", 1, cur)) for _ in range(2)] == [key_v2] * 2, "v2's files keyed as v1"


def test_an_adapters_digest_is_the_files_digests_as_before(tmp_path):
    """Reading through the files' identities keeps an adapter's key: its stored KV stays reachable."""
    path = _write_adapter(tmp_path / "x", b"v1", size=(1 << 20) + 7)
    top = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        top.update(f"{name}\0{weights_hash.hash_file(os.path.join(path, name))}\n".encode())
    assert AdapterKeys(SETTINGS).digest(path) == top.hexdigest()


def test_an_adapter_path_no_file_can_have_names_no_adapter(tmp_path):
    """vLLM's API takes any string as a path: one with a NUL is unreadable, not a scheduler crash."""
    assert AdapterKeys(SETTINGS).of(_lora("x", 1, f"{tmp_path}/x\0y")) is None


def test_an_adapter_being_uploaded_in_place_is_not_read_whole_by_every_request(tmp_path, monkeypatch):
    """Each request of an adapter whose weights file is being written read the whole partial file on
    vLLM's scheduler thread, then gave up: the read stops at the first chunk the file changed in, and
    the directory is not read again before ``CHANGING_RETRY_S``."""
    monkeypatch.setattr(weights_hash, "CHUNK_BYTES", 64 << 10)
    monkeypatch.setattr(lora_digest, "CHANGING_RETRY_S", 600.0, raising=False)
    path = _write_adapter(tmp_path / "x", b"v1", size=1 << 20)   # 16 chunks
    weights = os.path.join(path, "adapter_model.safetensors")
    hash_chunk = weights_hash._hash_chunk
    chunks_read = []
    uploading = True

    def read_while_uploading(fd, offset, nbytes):
        chunks_read.append(offset)
        if uploading:
            with open(weights, "ab") as f:   # the upload goes on writing while the file is read
                f.write(b"\0" * 4096)
        return hash_chunk(fd, offset, nbytes)

    monkeypatch.setattr(weights_hash, "_hash_chunk", read_while_uploading)
    adapters = AdapterKeys(SETTINGS)
    assert [adapters.of(_lora("x", 1, path)) for _ in range(5)] == [None] * 5
    assert len(chunks_read) <= 2, f"{len(chunks_read)} chunks read for 5 requests (config 1, weights 16)"
    uploading = False
    monkeypatch.setattr(lora_digest, "CHANGING_RETRY_S", 0.0, raising=False)
    assert adapters.of(_lora("x", 1, path)), "uploaded: named once the pause is over"


# -- a change of identity alone --------------------------------------------------------------------------
def test_a_chmod_of_an_adapter_while_its_request_runs_replaces_nothing(engine, tmp_path):
    """The files' identity changes (ctime) but not their contents: the running request goes on
    saving, and the requests vLLM serves from its prefix cache after are saved."""
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=PAGE)
    adapters = AdapterKeys(SETTINGS)
    adapters.watch_prefix_cache(pool)
    sched = _scheduler(engine, adapters)
    path = _write_adapter(tmp_path / "x", b"v1")
    lora = _lora("x", 1, path)
    request = _request("a", 320, lora)
    sched.num_new_matched_tokens(request, 0)
    assert _blocks(sched.build(_new("a", list(range(10, 20)), 0, 64)).saves) == 1   # chunked prefill
    weights = os.path.join(path, "adapter_model.safetensors")
    os.chmod(weights, 0o600 if os.stat(weights).st_mode & 0o777 != 0o600 else 0o640)
    rest = sched.build(_next_chunk("a", 64, 256)).saves
    assert _blocks(rest) == 4, "a chmod stopped the running request's saves"
    assert rest[0].adapter_files.unchanged(), "the new identity is kept: the worker saves the job"
    sched.finished(request)
    assert _blocks(_run(sched, "follow-up", lora, local_tokens=64)) == 5, \
        "a chmod stopped saving every request vLLM serves from its prefix cache"
    assert adapters.adapters_hashed == 2, "the same contents under a new identity: hashed once more"


# -- P/D ---------------------------------------------------------------------------------------------------
def test_a_prefill_whose_adapter_changed_while_its_saves_ran_announces_no_blocks(engine, tmp_path):
    """The worker drops saves run after the adapter's files changed; announced, the decode instance
    waited ``pd_wait_s`` for blocks that never land."""
    path = _write_adapter(tmp_path / "x", b"v1")
    prefill = _scheduler(engine, AdapterKeys(SETTINGS))
    request = _request("r", 320, _lora("x", 1, path, load_inplace=True))
    prefill.num_new_matched_tokens(request, 0)
    meta = prefill.build(_new("r", list(range(10, 20)), 0, 320))
    _write_adapter(path, b"v2")                      # replaced while the step runs
    store = build_store(StoreConfig(host_bytes="8MiB"), engine.layout)
    try:
        worker, _ = filled_worker(engine, store)
        worker.save(meta)
        assert worker.flush(10)
        assert worker.stats.adapter_saves_dropped == 5
        _, params = prefill.finished(request)
        assert params["kvtier_blocks"] == 0, "blocks the worker dropped announced"
        decode = _scheduler(engine, AdapterKeys(SETTINGS), lambda keys: store.lookup(keys).hit_blocks)
        waiting = _request("r", 320, _lora("x", 1, path))
        waiting.kv_transfer_params = params
        assert decode.num_new_matched_tokens(waiting, 0)[0] is not None, "the decode waits for them"
    finally:
        store.close(flush_timeout_s=0)


# -- files being written -----------------------------------------------------------------------------------
def _pool_watched(adapters: AdapterKeys):
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=PAGE)
    adapters.watch_prefix_cache(pool)
    return pool


def test_the_same_bytes_copied_over_a_loaded_adapter_refuse_only_the_request_that_sees_them_half_written(
        engine, tmp_path):
    """``cp`` of an adapter's own bytes over it (a backup restored, config management): a request
    that names the half-written file is refused, but vLLM never loaded that (a truncated file does
    not load) and the files end as it loaded them: the id's later requests, and those vLLM serves
    from its prefix cache, are saved again (they were refused for the life of the process)."""
    adapters = AdapterKeys(SETTINGS)
    _pool_watched(adapters)
    sched = _scheduler(engine, adapters)
    path = _write_adapter(tmp_path / "x", b"v1", size=1 << 20)
    weights = os.path.join(path, "adapter_model.safetensors")
    with open(weights, "rb") as f:
        original = f.read()
    assert _blocks(_run(sched, "a", _lora("x", 1, path))) == 5, "control: saved"

    with open(weights, "r+b") as f:                  # the copy: truncated, then written...
        f.truncate(0)
        f.write(original[: len(original) // 2])
    assert _run(sched, "mid-copy", _lora("x", 1, path)) == [], "KV saved under the half-written files' key"
    with open(weights, "r+b") as f:                  # ...to its end: the bytes vLLM loaded
        f.seek(len(original) // 2)
        f.write(original[len(original) // 2:])

    later = [_blocks(_run(sched, f"later-{i}", _lora("x", 1, path))) for i in range(2)]
    assert later == [5, 5], "the id refused for good after the same bytes were copied over it"
    assert _blocks(_run(sched, "served-from-prefix-cache", _lora("x", 1, path), local_tokens=64)) == 5, \
        "the adapter's pages in vLLM's prefix cache taken for another version's"


def test_a_running_request_that_sees_its_adapter_rewritten_stops_saving_and_no_other_does(engine, tmp_path):
    """A restore unlinks the file and writes it anew: the running request cannot name its adapter
    meanwhile and saves nothing more, but vLLM goes on computing with what it loaded under the id,
    which the files name again once written."""
    adapters = AdapterKeys(SETTINGS)
    _pool_watched(adapters)
    sched = _scheduler(engine, adapters)
    path = _write_adapter(tmp_path / "x", b"v1")
    weights = os.path.join(path, "adapter_model.safetensors")
    with open(weights, "rb") as f:
        original = f.read()
    request = _request("a", 320, _lora("x", 1, path))
    sched.num_new_matched_tokens(request, 0)
    assert _blocks(sched.build(_new("a", list(range(10, 20)), 0, 64)).saves) == 1   # chunked prefill
    os.remove(weights)                                # the restore starts
    assert sched.build(_next_chunk("a", 64, 256)).saves == [], "saved while its adapter's files were missing"
    with open(weights, "wb") as f:                    # restored: the same bytes, another inode
        f.write(original)
    sched.finished(request)
    assert _blocks(_run(sched, "next", _lora("x", 1, path))) == 5, "the id refused for good"
    assert _blocks(_run(sched, "served-from-prefix-cache", _lora("x", 1, path), local_tokens=64)) == 5


def test_another_version_that_stood_settled_s_refuses_the_id_after_the_files_are_rolled_back(
        engine, tmp_path, monkeypatch):
    """v2 written in place over a loaded v1 and left ``SETTLED_S``: vLLM may have loaded it at an
    eviction of the id, so the id's version is not known, and a rollback to v1's bytes is not
    served or saved either (vLLM may compute it with v2)."""
    monkeypatch.setattr(lora_digest, "SETTLED_S", 1.0, raising=False)
    adapters = AdapterKeys(SETTINGS)
    sched = _scheduler(engine, adapters)
    path = _write_adapter(tmp_path / "x", b"v1")
    assert _blocks(_run(sched, "a", _lora("x", 1, path))) == 5
    _write_adapter(path, b"v2")
    assert _run(sched, "v2-young", _lora("x", 1, path)) == []
    time.sleep(1.1)                                   # v2 stands: vLLM may load it now
    _write_adapter(path, b"v1")
    assert _run(sched, "rolled-back", _lora("x", 1, path)) == [], "v1's keys given to KV vLLM may compute with v2"

    _write_adapter(path, b"v2")
    assert _blocks(_run(sched, "v2-in-place", _lora("x", 2, path, load_inplace=True))) == 5
    _write_adapter(path, b"v1")
    monkeypatch.setattr(lora_digest, "SETTLED_S", 0.0, raising=False)   # v1 stood long before its first request
    assert _run(sched, "v1-settled", _lora("x", 2, path)) == []
    monkeypatch.setattr(lora_digest, "SETTLED_S", 1.0, raising=False)
    _write_adapter(path, b"v2")
    assert _run(sched, "v2-again", _lora("x", 2, path)) == [], "the id's version is not known any more"


def test_young_files_a_link_was_flipped_to_and_back_from_refuse_the_id(engine, tmp_path):
    """``cur`` flipped from v1 to freshly written v2 files and back: when it left v2 is not known
    from the files' times, so vLLM may have loaded v2 under the id meanwhile."""
    adapters = AdapterKeys(SETTINGS)
    sched = _scheduler(engine, adapters)
    cur = str(tmp_path / "cur")
    _point(cur, _write_adapter(tmp_path / "v1", b"one"))
    assert _blocks(_run(sched, "a", _lora("x", 1, cur))) == 5
    _point(cur, _write_adapter(tmp_path / "v2", b"two"))
    assert _run(sched, "v2", _lora("x", 1, cur)) == []
    _point(cur, str(tmp_path / "v1"))
    assert _run(sched, "v1-again", _lora("x", 1, cur)) == [], "v1's keys given to KV vLLM may compute with v2"


def test_the_ids_remembered_share_one_copy_of_their_adapters_key(tmp_path):
    """Each id remembered kept its own copy of its ~350-byte key: some 460 bytes an id, 30 MB at
    ``MAX_LOADED_IDS``."""
    adapters = AdapterKeys(SETTINGS)
    path = _write_adapter(tmp_path / "x", b"v1")
    assert adapters.for_request(_lora("x", 1, path)).key
    ids = 4000
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for lora_id in range(1000, 1000 + ids):
            adapters.for_request(_lora("x", lora_id, path))
        per_id = (tracemalloc.get_traced_memory()[0] - before) / ids
    finally:
        tracemalloc.stop()
    assert per_id < 250, f"{per_id:.0f} bytes per id remembered"


# -- files written while an engine serves them: bounds, identity changes, slow copies, uploads ----------
SHORT_SETTLED_S = 0.6


@pytest.fixture
def short_settled_s(monkeypatch) -> float:
    monkeypatch.setattr(lora_digest, "SETTLED_S", SHORT_SETTLED_S)
    return SHORT_SETTLED_S


def test_the_bound_on_ids_never_drops_the_id_being_named(tmp_path, monkeypatch):
    """Past ``MAX_ADAPTERS`` ids seeing files being written, the oldest is marked as holding an
    unknown version, which may push the least recently named id out of those remembered: that was
    the id being named, and naming it then raised KeyError (on vLLM's scheduler thread: the engine
    died)."""
    monkeypatch.setattr(lora_digest, "MAX_LOADED_IDS", 8)
    monkeypatch.setattr(lora_digest, "MAX_ADAPTERS", 2)
    adapters = AdapterKeys(SETTINGS)
    first, other = _write_adapter(tmp_path / "a", b"v1"), _write_adapter(tmp_path / "b", b"v1")
    assert adapters.for_request(_lora("a", 100, first)).key
    _write_adapter(first, b"v2")
    assert adapters.for_request(_lora("a", 100, first)).key is None, "being written"
    assert all(adapters.for_request(_lora("b", i, other)).key for i in range(1, 9))   # id 100 forgotten since
    _write_adapter(other, b"v2")
    # id 2 overflows the ids seeing files being written: id 100 is marked, which drops id 3
    assert [adapters.for_request(_lora("b", i, other)).key for i in (1, 2, 2)] == [None] * 3, \
        "requests of files being written under a loaded id served"


def _same_bytes_again(path: str, how: str) -> None:
    """The weights file's identity changes, its contents do not."""
    weights = os.path.join(path, "adapter_model.safetensors")
    if how == "chmod":
        os.chmod(weights, 0o600 if os.stat(weights).st_mode & 0o777 != 0o600 else 0o640)
    elif how == "touch":
        os.utime(weights)
    else:   # a redeploy: the same bytes written to a new file renamed over the old one
        with open(weights, "rb") as f:
            data = f.read()
        with open(weights + ".new", "wb") as f:
            f.write(data)
        os.replace(weights + ".new", weights)


@pytest.mark.parametrize("how", ["chmod", "touch", "redeploy"])
def test_a_step_whose_adapter_changed_identity_alone_before_its_save_stores_every_block_announced(
        engine, tmp_path, how):
    """The scheduler announced and passed the step's blocks when it built the step: the worker
    dropped them, and the request stored its later blocks behind that gap while a decode instance
    waited ``pd_wait_s`` for blocks that never landed. A ``chmod`` writes nothing: the worker saves
    the step. Written (a ``touch``, a redeploy), the files may have held another version within the
    step: the worker drops it, and the request saves and announces nothing more."""
    path, sched, request, store = _one_lora_request(engine, tmp_path)
    try:
        worker, _ = filled_worker(engine, store)
        first = sched.build(_new("r", list(range(10, 20)), 0, 64))      # chunk 1: block 0
        _same_bytes_again(path, how)                                    # before its wait_for_save
        worker.save(first)
        worker.save(sched.build(_next_chunk("r", 64, 256)))             # chunk 2: blocks 1..4 (chmod)
        assert worker.flush(10)
        _, params = sched.finished(request)
        keys = engine.keys(engine.block_hashes(request.block_hashes, 320), "", first.saves[0].adapter)
        assert worker.stats.adapter_saves_dropped == (0 if how == "chmod" else 1)
        assert store.lookup(keys).hit_blocks == params["kvtier_blocks"] == (5 if how == "chmod" else 0)
    finally:
        store.close(flush_timeout_s=0)


@pytest.mark.parametrize("how", ["touch", "redeploy"])
def test_a_prefill_whose_adapter_was_written_with_the_same_bytes_before_its_save_announces_no_dropped_block(
        engine, tmp_path, how):
    """The whole prompt in one step, its files written again before its ``wait_for_save``: the worker
    drops the step's saves (another version may have come and gone meanwhile); the prefill must
    not announce them to a decode instance, which would wait ``pd_wait_s`` for them."""
    path, sched, request, store = _one_lora_request(engine, tmp_path)
    try:
        worker, _ = filled_worker(engine, store)
        meta = sched.build(_new("r", list(range(10, 20)), 0, 320))
        _same_bytes_again(path, how)
        worker.save(meta)
        assert worker.flush(10)
        _, params = sched.finished(request)
        keys = engine.keys(engine.block_hashes(request.block_hashes, 320), "", meta.saves[0].adapter)
        assert worker.stats.adapter_saves_dropped == 5
        assert params["kvtier_blocks"] == store.lookup(keys).hit_blocks == 0, "blocks the worker dropped announced"
    finally:
        store.close(flush_timeout_s=0)


def test_another_version_written_and_rolled_back_within_a_step_drops_its_saves(engine, tmp_path):
    """``load_inplace``: vLLM reads the adapter's files at every step. Rewritten to v2 as the step
    starts (vLLM computes with v2) and rolled back to v1's bytes before its ``wait_for_save``: the
    files hash as v1, the version the step was named with, yet its KV is v2's. It was stored under
    v1's keys, for every later request of v1 to be served."""
    path, sched, request, store = _one_lora_request(engine, tmp_path, load_inplace=True)
    try:
        worker, _ = filled_worker(engine, store)
        meta = sched.build(_new("r", list(range(10, 20)), 0, 320))      # named v1
        _write_adapter(path, b"v2")                                     # vLLM computes the step with v2
        _write_adapter(path, b"v1")                                     # rolled back before the save
        worker.save(meta)
        assert worker.flush(10)
        _, params = sched.finished(request)
        keys = engine.keys(engine.block_hashes(request.block_hashes, 320), "", meta.saves[0].adapter)
        assert store.lookup(keys).hit_blocks == 0, "KV computed with v2 stored under v1's keys"
        assert worker.stats.adapter_saves_dropped == 5
        assert params["kvtier_blocks"] == 0, "blocks the worker dropped announced"
    finally:
        store.close(flush_timeout_s=0)


def _one_lora_request(engine, tmp_path, **lora_kw):
    """Adapter ``x`` written at v1, a scheduler, request ``r`` (320 tokens) of it looked up with
    nothing local, and an 8 MiB host store: what the save-path tests below start from."""
    path = _write_adapter(tmp_path / "x", b"v1")
    sched = _scheduler(engine, AdapterKeys(SETTINGS))
    request = _request("r", 320, _lora("x", 1, path, **lora_kw))
    sched.num_new_matched_tokens(request, 0)
    return path, sched, request, build_store(StoreConfig(host_bytes="8MiB"), engine.layout)


def _saved_and_announced(engine, sched, store, request, adapter: str) -> tuple[int, int]:
    """The blocks of ``request`` the store holds under ``adapter``'s keys, and those it announces."""
    _, params = sched.finished(request)
    keys = engine.keys(engine.block_hashes(request.block_hashes, 320), "", adapter)
    return store.lookup(keys).hit_blocks, params["kvtier_blocks"]


def test_a_chunk_computed_with_a_version_rolled_back_before_its_save_is_not_saved_at_the_next_chunk(
        engine, tmp_path):
    """``load_inplace``, v2 written and v1's bytes back between a chunk's build and its save: the
    worker drops the chunk's saves. The scheduler, seeing the files written with v1's bytes, planned
    the same blocks again from the same pages at the next chunk: v2's KV (and every later block,
    computed over it) stored under v1's keys, and announced to a decode instance."""
    path, sched, request, store = _one_lora_request(engine, tmp_path, load_inplace=True)
    try:
        worker, _ = filled_worker(engine, store)
        first = sched.build(_new("r", list(range(10, 20)), 0, 64))      # chunk 1: block 0, named v1
        _write_adapter(path, b"v2")                                     # vLLM computes chunk 1 with v2
        _write_adapter(path, b"v1")                                     # rolled back before its save
        worker.save(first)
        assert worker.stats.adapter_saves_dropped == 1
        second = sched.build(_next_chunk("r", 64, 256))                 # chunk 2: blocks 1..4
        assert second.saves == [], "blocks computed with v2, or over its KV, planned under v1's keys"
        worker.save(second)
        assert worker.flush(10)
        assert _saved_and_announced(engine, sched, store, request, first.saves[0].adapter) == (0, 0)
    finally:
        store.close(flush_timeout_s=0)


@pytest.mark.parametrize("rolled_back", [True, False], ids=["rolled back", "control: untouched"])
def test_a_request_vllm_serves_from_pages_a_rollback_computed_is_not_saved(engine, tmp_path, rolled_back):
    """The pages a ``load_inplace`` request computed while v2 stood and v1 came back sit in vLLM's
    prefix cache under the adapter's name and path: another request of the adapter that vLLM serves
    from them (64 local tokens) would save v2's KV under v1's keys. Control: files left alone, the
    same request saves its blocks."""
    path, sched, first_request, store = _one_lora_request(engine, tmp_path, load_inplace=True)
    try:
        worker, _ = filled_worker(engine, store)
        first = sched.build(_new("r", list(range(10, 20)), 0, 64))
        if rolled_back:
            _write_adapter(path, b"v2")
            _write_adapter(path, b"v1")
        worker.save(first)
        sched.build(_next_chunk("r", 64, 256))
        other = _request("s", 320, _lora("x", 1, path, load_inplace=True))
        sched.num_new_matched_tokens(other, 64)                        # block 0 from vLLM's prefix cache
        planned = sched.build(_new("s", list(range(30, 40)), 64, 256))
        assert bool(planned.saves) is not rolled_back, "pages computed with v2 saved under v1's keys"
    finally:
        store.close(flush_timeout_s=0)


def test_a_version_rolled_back_within_a_step_that_completes_no_block_stops_the_requests_saves(engine, tmp_path):
    """The same rollback within a step that completes no block (no save job: nothing for the worker
    to drop): the tokens it computed with v2 fill block 0, which was saved under v1's key at the
    next chunk, the files taken for v1 since they hash as v1."""
    path, sched, request, store = _one_lora_request(engine, tmp_path, load_inplace=True)
    try:
        worker, _ = filled_worker(engine, store)
        first = sched.build(_new("r", list(range(10, 20)), 0, 32))      # tokens 0..31: no block completes
        assert not first.saves
        _write_adapter(path, b"v2")                                     # vLLM computes them with v2
        _write_adapter(path, b"v1")                                     # rolled back
        worker.save(first)
        second = sched.build(_next_chunk("r", 32, 288))                 # blocks 0..4
        assert second.saves == [], "block 0 holds KV of tokens computed with v2, planned under v1's key"
        worker.save(second)
        assert worker.flush(10)
        v1 = sched.adapters.for_request(request.lora_request).key     # what v1's requests look up
        assert v1 and _saved_and_announced(engine, sched, store, request, v1) == (0, 0)
    finally:
        store.close(flush_timeout_s=0)


def test_a_step_whose_adapter_was_replaced_identity_and_all_before_its_save_is_dropped(engine, tmp_path):
    """Control: other bytes under a new identity are another version, hashed again or not."""
    path, sched, request, store = _one_lora_request(engine, tmp_path)
    try:
        worker, _ = filled_worker(engine, store)
        meta = sched.build(_new("r", list(range(10, 20)), 0, 320))
        os.remove(os.path.join(path, "adapter_model.safetensors"))
        _write_adapter(path, b"v2")
        worker.save(meta)
        assert worker.flush(10)
        assert worker.stats.adapter_saves_dropped == 5
        keys = engine.keys(engine.block_hashes(request.block_hashes, 320), "", meta.saves[0].adapter)
        assert store.lookup(keys).hit_blocks == 0
    finally:
        store.close(flush_timeout_s=0)


def test_the_same_bytes_restored_slowly_leave_the_id_its_version(tmp_path, short_settled_s):
    """``cp`` of the id's own bytes over its files takes longer than ``SETTLED_S`` in all, but no
    state of the files stood that long (each sighting within it of the one before): vLLM could
    have loaded none of them. The id was refused for good, as if another version had stood."""
    path = _write_adapter(tmp_path / "x", b"v1", size=256 << 10)
    weights = os.path.join(path, "adapter_model.safetensors")
    with open(weights, "rb") as f:
        data = f.read()
    adapters = AdapterKeys(SETTINGS)
    lora = _lora("x", 1, path)
    v1 = adapters.for_request(lora).key
    step = len(data) // 4
    with open(weights, "wb") as f:                    # truncated, then written a chunk at a time
        for i in range(4):
            f.write(data[i * step:(i + 1) * step])
            f.flush()
            time.sleep(short_settled_s / 2)
            if i < 3:
                assert adapters.for_request(lora).key is None, "half-written files named"
    assert adapters.for_request(lora).key == v1, "the id refused for good after the same bytes were restored"


def test_a_copy_with_a_state_that_stood_settled_s_unseen_refuses_the_id(tmp_path, short_settled_s):
    """Control: between two sightings the files stood ``SETTLED_S`` (a whole other version vLLM may
    have loaded at an eviction): the id's version is not known any more."""
    path = _write_adapter(tmp_path / "x", b"v1", size=256 << 10)
    weights = os.path.join(path, "adapter_model.safetensors")
    with open(weights, "rb") as f:
        data = f.read()
    adapters = AdapterKeys(SETTINGS)
    lora = _lora("x", 1, path)
    assert adapters.for_request(lora).key
    third = len(data) // 3
    with open(weights, "wb") as f:
        f.write(data[:third])
        f.flush()
        time.sleep(short_settled_s / 4)
        assert adapters.for_request(lora).key is None
        f.write(data[third:2 * third])
        f.flush()
        time.sleep(short_settled_s + 0.2)             # this state stands, unseen
        f.write(data[2 * third:])
        f.flush()
    time.sleep(short_settled_s / 4)
    assert adapters.for_request(lora).key is None, "v1's keys given to KV vLLM may compute with another state"


def test_another_version_that_stood_settled_s_while_chmods_moved_its_ctime_refuses_the_id_after_a_rollback(
        tmp_path, short_settled_s):
    """v2 written whole over a loaded v1 stands ``SETTLED_S`` and more (vLLM may load it at an
    eviction), seen by each request, while a ``chmod`` every half ``SETTLED_S`` keeps its ctime young:
    each sighting within ``SETTLED_S`` of the one before. v1's bytes written back were taken for the
    id's version again, though vLLM may compute its requests with v2."""
    path = _write_adapter(tmp_path / "x", b"v1")
    config = os.path.join(path, "adapter_config.json")
    adapters = AdapterKeys(SETTINGS)
    lora = _lora("x", 1, path)
    v1 = adapters.for_request(lora).key
    _write_adapter(path, b"v2")
    standing = time.monotonic()
    while time.monotonic() - standing < 2 * short_settled_s:         # v2 stands; its modes change
        assert adapters.for_request(lora).key is None, "v2's request named as v1"
        time.sleep(short_settled_s / 2)
        os.chmod(config, 0o600 if os.stat(config).st_mode & 0o777 != 0o600 else 0o640)
    _write_adapter(path, b"v1")
    assert adapters.for_request(lora).key != v1, "v1's keys given to KV vLLM may compute with v2"


def test_the_same_bytes_restored_slowly_under_chmods_leave_the_id_its_version(tmp_path, short_settled_s):
    """Control: the states of a slow copy of the id's own bytes (none standing ``SETTLED_S``) are
    followed by their contents; a ``chmod`` while one is seen (its ctime moved, its contents not)
    does not make it stand longer."""
    path = _write_adapter(tmp_path / "x", b"v1", size=256 << 10)
    weights = os.path.join(path, "adapter_model.safetensors")
    with open(weights, "rb") as f:
        data = f.read()
    adapters = AdapterKeys(SETTINGS)
    lora = _lora("x", 1, path)
    v1 = adapters.for_request(lora).key
    half = len(data) // 2
    with open(weights, "wb") as f:
        f.write(data[:half])
        f.flush()
        assert adapters.for_request(lora).key is None
        time.sleep(short_settled_s / 3)
        os.chmod(weights, 0o600 if os.stat(weights).st_mode & 0o777 != 0o600 else 0o640)
        assert adapters.for_request(lora).key is None, "half-written files named"
        time.sleep(short_settled_s / 3)
        f.write(data[half:])
    assert adapters.for_request(lora).key == v1, "the id refused for good after the same bytes were restored"


def _lora_weights(seed: int, rank: int) -> bytes:
    """An adapter's weights file as PEFT writes it: a safetensors header, then the tensors."""
    import numpy as np
    from safetensors.numpy import save

    rng = np.random.default_rng(seed)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    return save({f"{prefix}.lora_A.weight": rng.standard_normal((rank, 256), dtype=np.float32),
                 f"{prefix}.lora_B.weight": rng.standard_normal((256, rank), dtype=np.float32)})


def _write_lora(path, seed: int, rank: int) -> str:
    """A loadable adapter written in place (same inodes), as a retrain or an upload leaves it."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        f.write(f'{{"r": {rank}, "lora_alpha": 16, "target_modules": ["q_proj"]}}')
    with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
        f.write(_lora_weights(seed, rank))
    return str(path)


def test_young_whole_files_first_named_then_a_longer_version_in_place_refuse_the_id(
        engine, tmp_path, short_settled_s):
    """vLLM loads whole files however young: named at the id's first request, they are the version
    vLLM holds under the id. A longer version written over them in place, however soon (no upload
    caught part way: the first files were whole), is computed with the first one's weights: its
    requests are refused, for good once it stood ``SETTLED_S``."""
    path = _write_lora(tmp_path / "x", seed=1, rank=8)
    sched = _scheduler(engine, AdapterKeys(SETTINGS))
    lora = _lora("x", 1, path)
    assert _blocks(_run(sched, "first", lora)) == 5
    _write_lora(path, seed=2, rank=16)
    assert _run(sched, "longer", lora) == [], "the longer version's keys given to KV computed with the first"
    time.sleep(short_settled_s + 0.1)
    assert _run(sched, "settled", lora) == []


def test_an_upload_over_a_registered_adapter_caught_part_way_at_its_first_request_refuses_the_id(
        engine, tmp_path, short_settled_s):
    """vLLM's server loads an adapter when it is registered (``/v1/load_lora_adapter``,
    ``--lora-modules``: ``add_lora`` "will also preload it for incoming requests"), and reads its
    files again only after an eviction or with ``load_inplace``. Files found part way through an
    upload at the id's first request are being written over the registered version, which vLLM
    computes the id's requests with: the uploaded version's requests are refused, for good once it
    stood ``SETTLED_S``. (An id's first naming is not known to be when vLLM read its files, so the
    uploaded version cannot be taken for the id's, though vLLM cannot load the truncated files.)"""
    path = _write_lora(tmp_path / "x", seed=1, rank=8)            # registered: vLLM holds this version
    time.sleep(short_settled_s + 0.1)
    sched = _scheduler(engine, AdapterKeys(SETTINGS))
    lora = _lora("x", 1, path)
    uploaded = _lora_weights(seed=2, rank=16)
    with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
        f.write(uploaded[: len(uploaded) // 2])
        f.flush()
        _run(sched, "mid-upload", lora)
        f.write(uploaded[len(uploaded) // 2:])
    assert _run(sched, "uploaded", lora) == [], "the uploaded version's keys given to the registered one's KV"
    time.sleep(short_settled_s + 0.1)
    assert _run(sched, "settled", lora) == []
