"""A LoRA request's block keys name its adapter's files and the engine's LoRA settings, not only
the adapter's name and path (vLLM's block hashes): an adapter replaced at the same path, or served
by an engine that computes it in another dtype, never gets the other's KV from kvtier's store.
Requests without an adapter keep their keys, and base-model blocks stay shared between engines
with and without LoRA.

An adapter's files replaced while the engine runs: a request in flight saves nothing it computed
after (vLLM may have read the new files), and requests that vLLM's own prefix cache (keyed by name
and path only) may have served the other version's pages save nothing until that cache is reset.

The digest, scheduler and worker tests run without an engine; the last three run two engines
(started together) on one disk directory: ``writer`` (LoRA in the model's dtype, float32) and
``reader`` (LoRA in bfloat16).
"""
from __future__ import annotations

import logging
import shutil
from types import SimpleNamespace

import pytest

from tests.integrations.vllm.harness import expected_hit, loaded_tokens, prompts, skip_without_vllm

skip_without_vllm()

from kvtier.core.layout import KVLayout  # noqa: E402
from kvtier.core.namespace import Namespace  # noqa: E402
from kvtier.integrations.transformers.models import random_lora_adapter  # noqa: E402
from kvtier.integrations.vllm.config import ConnectorConfig, EngineKV  # noqa: E402
from kvtier.integrations.vllm import lora_digest  # noqa: E402
from kvtier.integrations.vllm.lora_digest import AdapterKeys, lora_settings  # noqa: E402
from kvtier.integrations.vllm.metadata import KvtierMetadata  # noqa: E402
from kvtier.integrations.vllm.scheduler_side import SchedulerSide  # noqa: E402
from kvtier.store.config import StoreConfig, build_store  # noqa: E402
from tests.integrations.vllm.test_worker_saves import filled_worker  # noqa: E402

PAGE, BLOCK = 32, 64
HASHES = [bytes([i]) * 32 for i in range(3)]
#: the last key of HASHES as kvtier keyed it before adapters were named (no epoch; epoch "e1"):
#: a request without an adapter must keep it, or every store filled before misses
PINNED_KEY = "7c2355a314a0b9384b16b64e8f85bc48af62c9949c6fc91c4744b8f0244714b2"
PINNED_EPOCH_KEY = "a3068756306824d111b1ddbe1c4257895d02ddc01a1f06eec23061fa57e24a7b"
SETTINGS = {"lora_dtype": "float32", "max_lora_rank": 8}


def _lora(name: str, lora_id: int, path, **kw):
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, lora_id, str(path), **kw)


@pytest.fixture
def engine() -> EngineKV:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32", block_tokens=BLOCK)
    return EngineKV(Namespace("m", layout), page_tokens=PAGE, hash_tokens=PAGE, num_layers=2, format_tag="test")


# -- the adapter's identity, without an engine ------------------------------------------------------
def test_keys_of_requests_without_an_adapter_are_those_kvtier_always_gave(engine):
    assert bytes(engine.keys(HASHES)[-1]).hex() == PINNED_KEY
    assert bytes(engine.keys(HASHES, "e1")[-1]).hex() == PINNED_EPOCH_KEY
    assert bytes(engine.keys(HASHES, "", "")[-1]).hex() == PINNED_KEY
    with_adapter = engine.keys(HASHES, "", "vllm-lora/1 x")
    assert not set(with_adapter) & set(engine.keys(HASHES))
    assert not set(with_adapter) & set(engine.keys(HASHES, "", "vllm-lora/1 y"))


def test_an_adapters_identity_follows_its_files_and_each_version_is_hashed_once(tiny_model, tmp_path):
    adapters = AdapterKeys(SETTINGS)
    path = random_lora_adapter(tiny_model, tmp_path / "customer-x", seed=1)
    first = adapters.of(_lora("customer-x", 1, path))
    assert first and adapters.of(_lora("customer-x", 2, path)) == first
    assert adapters.adapters_hashed == 1, "an unchanged adapter is not read again for each request"
    # retrained in place: the same name and path, other weights (the files overwritten, same inodes)
    random_lora_adapter(tiny_model, path, seed=3)
    retrained = adapters.of(_lora("customer-x", 2, path))
    assert retrained not in (None, first) and adapters.adapters_hashed == 2
    # the same weights under another adapter_config.json (another lora_alpha scales them otherwise)
    config = tmp_path / "customer-x" / "adapter_config.json"
    config.write_text(config.read_text().replace('"lora_alpha": 16', '"lora_alpha": 32'))
    assert adapters.of(_lora("customer-x", 2, path)) not in (None, first, retrained)
    # the same files elsewhere (another host's copy) name the same adapter contents
    copy = shutil.copytree(tmp_path / "customer-x", tmp_path / "elsewhere")
    assert adapters.of(_lora("customer-x", 2, copy)) == adapters.of(_lora("customer-x", 2, path))
    # the engine's LoRA settings are part of it
    assert AdapterKeys({**SETTINGS, "lora_dtype": "bfloat16"}).of(_lora("customer-x", 2, path)) != \
        adapters.of(_lora("customer-x", 2, path))
    assert adapters.of(None) == ""


def test_an_adapter_whose_files_cannot_be_read_has_no_identity_and_is_reported_once(tiny_model, tmp_path, caplog):
    adapters = AdapterKeys(SETTINGS)
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "adapter_config.json").write_text("{}")
    hub = _lora("hub", 1, "some-org/some-adapter-kvtier-test")   # a hub name: vLLM would download it
    with caplog.at_level(logging.WARNING, logger="kvtier.integrations.vllm.lora_digest"):
        assert adapters.of(hub) is None and adapters.of(hub) is None
        assert adapters.of(_lora("gone", 2, tmp_path / "missing")) is None
        assert adapters.of(_lora("half", 3, no_weights)) is None
    assert sum("some-org/some-adapter-kvtier-test" in r.getMessage() for r in caplog.records) == 1


def test_what_an_adapter_keys_remembers_is_bounded(tiny_model, tmp_path, monkeypatch, caplog):
    """One entry per adapter version, unreadable adapter and adapter name and path ever seen would
    grow without end (thousands of adapters loaded and unloaded): the oldest are forgotten."""
    monkeypatch.setattr(lora_digest, "MAX_ADAPTERS", 2)
    monkeypatch.setattr(lora_digest, "MAX_CACHED_NAMES", 2)
    adapters = AdapterKeys(SETTINGS)
    loras = [_lora(f"ad{i}", i + 1, random_lora_adapter(tiny_model, tmp_path / f"ad{i}", seed=i)) for i in range(3)]
    for lora in loras:
        adapters.of(lora)
    adapters.of(loras[2])
    assert adapters.adapters_hashed == 3, "the latest adapter is remembered"
    adapters.of(loras[0])
    assert adapters.adapters_hashed == 4, "the oldest adapter was forgotten: hashed again"
    # log-once of unreadable adapters: the oldest forgotten, so logged again
    with caplog.at_level(logging.WARNING, logger="kvtier.integrations.vllm.lora_digest"):
        for name in ("gone-0", "gone-1", "gone-2", "gone-0"):
            assert adapters.of(_lora(name, 9, tmp_path / name)) is None
    assert sum("'gone-0'" in r.getMessage() for r in caplog.records) == 2
    # the versions vLLM's prefix cache holds: a name and path forgotten counts as holding any version
    for lora in loras:
        assert adapters.note_in_prefix_cache(lora, adapters.of(lora))
    assert not adapters.note_in_prefix_cache(loras[0], adapters.of(loras[0]))


def test_the_lora_settings_that_change_the_computation_are_digested(tiny_model):
    from vllm.engine.arg_utils import EngineArgs

    def settings(**lora):
        args = {"dtype": "float32", "block_size": 32, "max_model_len": 2048, "enforce_eager": True, **lora}
        return lora_settings(EngineArgs(model=tiny_model, **args).create_engine_config())

    auto = settings(enable_lora=True, max_lora_rank=8)
    assert settings() is None
    assert auto["lora_dtype"] == "float32", "auto is the model's dtype"
    assert settings(enable_lora=True, max_lora_rank=8, lora_dtype="bfloat16")["lora_dtype"] == "bfloat16"
    assert settings(enable_lora=True, max_lora_rank=8, max_loras=4, max_cpu_loras=8) == auto
    assert settings(enable_lora=True, max_lora_rank=8, fully_sharded_loras=True) != auto


# -- the scheduler side names a request's adapter, and hands it to the workers ----------------------
def _request(req_id: str, num_tokens: int, lora=None):
    hashes = [f"{req_id}:{i}".encode().ljust(32, b".") for i in range(num_tokens // PAGE)]
    return SimpleNamespace(request_id=req_id, num_tokens=num_tokens, block_hashes=hashes, kv_transfer_params=None,
                           lora_request=lora)


def _new(req_id: str, pages: list[int], computed: int, scheduled: int):
    new = SimpleNamespace(req_id=req_id, block_ids=(pages,), num_computed_tokens=computed, scheduled=scheduled)
    cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
    return SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
                           num_scheduled_tokens={req_id: scheduled}, total_num_scheduled_tokens=scheduled)


def _next_chunk(req_id: str, computed: int, scheduled: int):
    """A step that runs ``scheduled`` more tokens of a running request (its pages allocated before)."""
    cached = SimpleNamespace(req_ids=[req_id], resumed_req_ids=set(), new_block_ids=[None],
                             num_computed_tokens=[computed])
    return SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached,
                           num_scheduled_tokens={req_id: scheduled}, total_num_scheduled_tokens=scheduled)


def test_a_lora_requests_lookup_and_saves_are_keyed_by_its_adapter(engine, tiny_model, tmp_path):
    looked_up: list = []
    adapters = AdapterKeys(SETTINGS)
    sched = SchedulerSide(ConnectorConfig(block_tokens=BLOCK), engine, lambda keys: looked_up.append(keys) or 0,
                          loads=True, saves=True, adapters=adapters)
    lora = _lora("x", 1, random_lora_adapter(tiny_model, tmp_path / "x", seed=1))
    req = _request("a", 300, lora)
    assert sched.num_new_matched_tokens(req, 0) == (0, False)
    (save,) = sched.build(_new("a", list(range(10, 20)), 0, 300)).saves
    hashes = engine.block_hashes(req.block_hashes, 300)
    assert save.adapter == adapters.of(lora) != ""
    # the worker keys the save as the scheduler looked it up, and neither as a base request
    assert looked_up == [engine.keys(hashes, "", save.adapter)]
    assert not set(looked_up[0]) & set(engine.keys(hashes))


def test_a_request_whose_adapter_cannot_be_read_is_neither_looked_up_nor_saved(engine):
    looked_up: list = []
    sched = SchedulerSide(ConnectorConfig(block_tokens=BLOCK), engine, lambda keys: looked_up.append(keys) or 9,
                          loads=True, saves=True, adapters=AdapterKeys(SETTINGS))
    req = _request("h", 300, _lora("hub", 1, "some-org/some-adapter-kvtier-test"))
    assert sched.num_new_matched_tokens(req, 0) == (0, False)
    assert sched.build(_new("h", list(range(10, 20)), 0, 300)).saves == []
    assert looked_up == []
    # control: the same request without an adapter is looked up and saved
    base = _request("b", 300)
    assert sched.num_new_matched_tokens(base, 0)[0] == 288 and looked_up


def test_a_request_in_flight_while_its_adapter_is_replaced_saves_nothing_computed_after(engine, tiny_model,
                                                                                           tmp_path):
    """vLLM reads an adapter's files again while a request runs (after an unload, at every step with
    ``load_inplace``): blocks computed with the new files must not be saved under the old ones' keys,
    neither those planned after the change (scheduler) nor those planned before it and run after it
    (worker, once vLLM loaded the step's adapters)."""
    looked_up: list = []
    sched = SchedulerSide(ConnectorConfig(block_tokens=BLOCK), engine, lambda keys: looked_up.append(keys) or 0,
                          loads=True, saves=True, adapters=AdapterKeys(SETTINGS))
    path = random_lora_adapter(tiny_model, tmp_path / "x", seed=1)
    req = _request("a", 320, _lora("x", 1, path))
    assert sched.num_new_matched_tokens(req, 0) == (0, False)
    (first,) = sched.build(_new("a", list(range(10, 20)), 0, 64)).saves      # chunked prefill: block 0
    (second,) = sched.build(_next_chunk("a", 64, 64)).saves                  # block 1, not run yet
    store = build_store(StoreConfig(host_bytes="8MiB"), engine.layout)
    try:
        worker, _ = filled_worker(engine, store)
        worker.save(KvtierMetadata(saves=[first]))      # control: run before the change, saved
        random_lora_adapter(tiny_model, path, seed=3)   # the operator puts v2's files at the path
        worker.save(KvtierMetadata(saves=[second]))     # run after: vLLM may have loaded v2 for it
        assert worker.flush(10)
        keys = engine.keys(second.hashes, "", second.adapter)
        assert store.lookup(keys).hit_blocks == 1, "only the block computed before the change is stored"
        assert worker.stats.adapter_saves_dropped == 1
    finally:
        store.close(flush_timeout_s=0)
    assert sched.build(_next_chunk("a", 128, 64)).saves == [], "block 2, computed with v2, saved under v1's keys"
    assert sched.build(_next_chunk("a", 192, 128)).saves == []
    assert sched.num_new_matched_tokens(req, 0) == (0, False) and len(looked_up) == 1, "nor looked up again"


def test_after_an_adapter_is_replaced_in_place_vllms_prefix_hits_are_not_saved_until_it_is_reset(engine, tiny_model,
                                                                                                  tmp_path):
    """vLLM's own prefix cache keys an adapter's pages by its name and path: after its files are replaced
    in place it serves one version the other's pages. A request it served from that cache must save
    nothing (it would store the old version's KV under the new version's keys), until vLLM's prefix
    cache is reset (seen through its block pool, as vLLM binds it to the connector). The adapter is
    requested with ``load_inplace``, so that vLLM computes with the files at the path (it reads
    them again at each step)."""
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=PAGE)
    adapters = AdapterKeys(SETTINGS)
    adapters.watch_prefix_cache(pool)
    sched = SchedulerSide(ConnectorConfig(block_tokens=BLOCK), engine, lambda keys: 0, loads=True, saves=True,
                          adapters=adapters)
    path = random_lora_adapter(tiny_model, tmp_path / "x", seed=1)
    lora = _lora("x", 1, path, load_inplace=True)

    def saves(req_id: str, local_tokens: int) -> int:
        """Blocks saved of a request of ``lora`` whose first ``local_tokens`` vLLM's prefix cache served."""
        assert sched.num_new_matched_tokens(_request(req_id, 320, lora), local_tokens) == (0, False)
        jobs = sched.build(_new(req_id, list(range(10, 20)), local_tokens, 320 - local_tokens)).saves
        return sum(len(job.blocks) for job in jobs)

    assert saves("v1", 0) == 5 and saves("v1-again", 64) == 5, "one version: its own pages"
    random_lora_adapter(tiny_model, path, seed=3)   # retrained in place
    assert saves("v2-from-vllm-cache", 64) == 0, "v1's pages saved under v2's keys"
    assert saves("v2-computed", 0) == 5, "control: a request vLLM served nothing computes v2 alone"
    random_lora_adapter(tiny_model, path, seed=1)   # rolled back: vLLM's cache holds v2's pages now too
    assert saves("v1-from-vllm-cache", 64) == 0
    assert pool.reset_prefix_cache()
    assert saves("v1-after-reset", 0) == 5 and saves("v1-after-reset-cached", 64) == 5


# -- engines ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lora_engines(engines, tiny_model, tmp_path_factory):
    """``writer`` (LoRA in float32, the model's dtype) and ``reader`` (LoRA in bfloat16) on one disk
    directory, without host tiers (every block comes from disk), started together."""
    disk = tmp_path_factory.mktemp("lora-disk")
    extra = {"block_tokens": BLOCK, "host_bytes": 0, "disk_path": str(disk), "disk_bytes": "256MiB"}
    lora = {"enable_lora": True, "max_lora_rank": 8}
    writer = engines("lora-writer", {"model": tiny_model, "extra": extra, "engine_args": lora})
    reader = engines("lora-reader", {"model": tiny_model, "extra": extra,
                                     "engine_args": {**lora, "lora_dtype": "bfloat16"}})
    writer.wait_ready()
    reader.wait_ready()
    return SimpleNamespace(writer=writer, reader=reader)


def _adapter(name: str, lora_id: int, path) -> dict:
    return {"name": name, "id": lora_id, "path": str(path)}


@pytest.mark.timeout(400)
def test_an_adapter_replaced_at_its_path_is_never_served_its_old_versions_kv(lora_engines, tiny_model, tmp_path):
    """An adapter retrained in place (same name, same path) and served under a new id, as after
    a restart: vLLM's block hashes are those of the old version, kvtier's store holds its KV."""
    writer = lora_engines.writer
    path = tmp_path / "adapters" / "customer-x"
    random_lora_adapter(tiny_model, path, seed=1)
    batch = prompts(1, 320, seed=31)
    (old,) = writer.generate(batch, lora=_adapter("customer-x", 1, path), max_tokens=6)
    writer.call(op="flush")
    assert writer.call(op="reset")["ok"]   # vLLM's own cache emptied; kvtier's disk keeps the blocks
    shutil.rmtree(path)
    random_lora_adapter(tiny_model, path, seed=3)
    (new,) = writer.generate(batch, lora=_adapter("customer-x", 2, path), max_tokens=6)
    assert loaded_tokens(new) == 0, "the new adapter version was served the old version's KV"
    assert new["logprobs"] != old["logprobs"], "control: the new version computes otherwise"
    writer.call(op="flush")
    assert writer.call(op="reset")["ok"]
    (again,) = writer.generate(batch, lora=_adapter("customer-x", 2, path), max_tokens=6)
    assert loaded_tokens(again) == expected_hit(320, BLOCK) > 0, "the new version's own KV is served"
    assert again["token_ids"] == new["token_ids"] and again["logprobs"] == new["logprobs"]


@pytest.mark.timeout(400)
def test_an_adapter_replaced_in_place_without_resetting_vllms_cache_stores_none_of_the_old_versions_kv(
        lora_engines, tiny_model, tmp_path):
    """The same, with vLLM's prefix cache not reset before the new version's first request: vLLM serves it
    the old version's pages (its own cache keys them by name and path), which kvtier must not store
    under the new version's keys, where every later request of the new version, after a restart or on
    another host, would get them."""
    writer = lora_engines.writer
    path = tmp_path / "adapters" / "customer-y"
    random_lora_adapter(tiny_model, path, seed=1)
    batch = prompts(1, 320, seed=33)
    writer.generate(batch, lora=_adapter("customer-y", 21, path), max_tokens=6)
    shutil.rmtree(path)
    random_lora_adapter(tiny_model, path, seed=3)
    (mixed,) = writer.generate(batch, lora=_adapter("customer-y", 22, path), max_tokens=6)
    assert mixed["num_cached_tokens"] > loaded_tokens(mixed) == 0, "control: vLLM served the old version's pages"
    writer.call(op="flush")
    assert writer.call(op="reset")["ok"]   # as a restart: vLLM's own cache emptied, kvtier's disk kept
    (cold,) = writer.generate(batch, lora=_adapter("customer-y", 23, path), max_tokens=6)
    assert loaded_tokens(cold) == 0, "the old version's KV was stored under the new version's keys"
    assert "reset vLLM's prefix cache" in writer.tail(100_000), "the operator is told what to do"
    writer.call(op="flush")
    assert writer.call(op="reset")["ok"]
    (again,) = writer.generate(batch, lora=_adapter("customer-y", 24, path), max_tokens=6)
    assert loaded_tokens(again) == expected_hit(320, BLOCK) > 0, "after the reset, the new version is stored"
    assert again["token_ids"] == cold["token_ids"] and again["logprobs"] == cold["logprobs"]


@pytest.mark.timeout(400)
def test_an_engine_computing_lora_in_another_dtype_gets_only_the_base_models_kv(lora_engines, tiny_model, tmp_path):
    """The same adapter files under the same name and path: the bfloat16-LoRA reader must not load
    the float32 writer's adapter KV, and loads its base-model KV, which is the same."""
    writer, reader = lora_engines.writer, lora_engines.reader
    path = random_lora_adapter(tiny_model, tmp_path / "ad", seed=5)
    ad = _adapter("ad", 11, path)   # an id of its own: vLLM keeps an adapter loaded under its id
    batch = prompts(1, 320, seed=32)
    (base,) = writer.generate(batch, max_tokens=6)
    (adapted,) = writer.generate(batch, lora=ad, max_tokens=6)
    writer.call(op="flush")
    (mine,) = reader.generate(batch, lora=ad, max_tokens=6)
    assert loaded_tokens(mine) == 0, "the bfloat16-LoRA engine loaded KV of the float32-LoRA one"
    assert mine["logprobs"] != adapted["logprobs"], "control: the LoRA dtype changes the computation"
    (shared,) = reader.generate(batch, max_tokens=6)
    assert loaded_tokens(shared) == expected_hit(320, BLOCK) > 0, "base-model blocks are shared"
    assert shared["token_ids"] == base["token_ids"] and shared["logprobs"] == base["logprobs"]
    reader.call(op="flush")
    assert reader.call(op="reset")["ok"]
    (own,) = reader.generate(batch, lora=ad, max_tokens=6)
    assert loaded_tokens(own) == expected_hit(320, BLOCK), "the reader's own adapter KV is served"
    assert own["token_ids"] == mine["token_ids"] and own["logprobs"] == mine["logprobs"]
