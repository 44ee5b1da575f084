"""The vLLM integration against hosts, layouts, names and settings that would turn it against itself.

No vLLM engine is started (vLLM's own configuration objects, kernels-free checks, a fake ``vllm``
package for the engine process): the whole file runs in seconds, after vLLM's argument parser is
built once (several seconds).

* the page-format tag follows the dtype vLLM's CPU kernels pick the page layout from (the model's)
* pipeline-parallel stages key their own layers apart, and each serves its own lookup socket
* lookup sockets are named by a digest: distinct engine ids never share one, and the path fits
* the launcher reads the command line with vLLM's own parser
* ``shutdown_flush_s`` is bounded
* an engine process drops a reply that comes after its command timed out
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import textwrap
import threading
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from tests.integrations.vllm.harness import skip_without_vllm

skip_without_vllm()

import torch  # noqa: E402

from kvtier.errors import ConfigError  # noqa: E402
from kvtier.integrations.vllm import cpu_pages  # noqa: E402
from kvtier.integrations.vllm.config import ConnectorConfig, engine_kv  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _vllm_config(*, model_dtype=torch.bfloat16, cache_dtype="auto", tp=1, pp=1):
    """The parts of vLLM's VllmConfig that ``engine_kv`` and the connector read."""
    from transformers import LlamaConfig

    # the model vLLM runs, digested into every key (config.model_computation_digest)
    hf = LlamaConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, head_dim=32, num_hidden_layers=2)
    return SimpleNamespace(
        cache_config=SimpleNamespace(prefix_caching_hash_algo="sha256", cache_dtype=cache_dtype),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        model_config=SimpleNamespace(model="m", revision=None, dtype=model_dtype, hf_config=hf, hf_text_config=hf,
                                     architecture="LlamaForCausalLM", quantization=None),
        load_config=SimpleNamespace(load_format="auto"),
        attention_config=SimpleNamespace(backend=None),
    )


def _kv_cache_config(spec, layer_names):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(layer_names=list(layer_names), kv_cache_spec=spec)])


def _layers(indices):
    return [f"model.layers.{i}.self_attn.attn" for i in indices]


HASHES = [bytes([i]) * 32 for i in range(3)]


@pytest.fixture
def short_dir():
    """A directory short enough for Unix socket paths in it (pytest's tmp_path is not)."""
    path = tempfile.mkdtemp(prefix="k", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


# == D1: the page-format tag follows the model dtype =============================================
def _host(monkeypatch, amx: bool) -> None:
    """Make this process look like an x86 host with AVX-512, with AMX tiles or without."""
    monkeypatch.setattr(cpu_pages.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)


def _tags_and_isas(monkeypatch, model_dtype, cache_dtype, spec_dtype):
    """The format tag kvtier gives, and the ISA vLLM's CPU attention builder picks, per host."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=spec_dtype)
    tags, isas = {}, {}
    for amx in (True, False):
        _host(monkeypatch, amx)
        # what CPUAttentionMetadataBuilder computes: the *model* dtype
        isas[amx] = _get_attn_isa(model_dtype, 32, 64, cache_dtype)
        tags[amx] = engine_kv(ConnectorConfig(block_tokens=64), _vllm_config(model_dtype=model_dtype,
                                                                             cache_dtype=cache_dtype),
                              _kv_cache_config(spec, _layers((0, 1)))).format_tag
    return tags, isas


def test_an_fp8_cache_of_a_bfloat16_model_gets_other_tags_on_amx_and_vector_hosts(monkeypatch):
    """``--kv-cache-dtype fp8`` gives uint8 pages, but vLLM lays them out by the model's bfloat16:
    ``amx`` on a host with AMX tiles, ``vec`` on an AVX-512 one. The tag asked with the cache's
    dtype named both ``vec``: hosts sharing a tier loaded each other's pages as other KV."""
    tags, isas = _tags_and_isas(monkeypatch, torch.bfloat16, "fp8", torch.uint8)
    assert isas == {True: "amx", False: "vec"}, isas     # control: vLLM writes two layouts
    assert tags[True] != tags[False], tags[True]
    assert '"page_format": "cpu_attn:amx"' in tags[True] and '"page_format": "cpu_attn:vec"' in tags[False]


def test_a_bfloat16_cache_of_a_float32_model_is_tagged_as_the_vector_pages_vllm_writes(monkeypatch):
    """The other way round: a float32 model with a bfloat16 cache is laid out ``vec`` on both
    hosts (vLLM asks with float32), so both hosts share the tag (the cache's dtype named the AMX
    host's pages ``amx``, splitting a cache that is the same bytes)."""
    tags, isas = _tags_and_isas(monkeypatch, torch.float32, "bfloat16", torch.bfloat16)
    assert isas == {True: "vec", False: "vec"}, isas
    assert tags[True] == tags[False] and '"page_format": "cpu_attn:vec"' in tags[True]


def test_a_bfloat16_model_with_its_own_cache_dtype_keeps_its_tags(monkeypatch):
    """Control: with ``--kv-cache-dtype auto`` the model's and the cache's dtype agree; the tags
    (so the keys of such engines) are what they were, ``amx`` and ``vec``."""
    tags, isas = _tags_and_isas(monkeypatch, torch.bfloat16, "auto", torch.bfloat16)
    assert isas == {True: "amx", False: "vec"}
    assert '"page_format": "cpu_attn:amx"' in tags[True] and '"page_format": "cpu_attn:vec"' in tags[False]
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    _host(monkeypatch, amx=True)   # without a model dtype, page_format asks with the spec's, as before
    assert cpu_pages.page_format(spec, "auto") == "cpu_attn:amx"


# == D2: pipeline stages key their own layers, and each serves its own lookups ===================
def _stage(pp_rank: int, layer_indices, *, pp=2, tp_rank=0):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    return engine_kv(ConnectorConfig(block_tokens=64), _vllm_config(model_dtype=torch.float32, pp=pp),
                     _kv_cache_config(spec, _layers(layer_indices)), tp_rank=tp_rank, pp_rank=pp_rank)


def test_two_pipeline_stages_of_as_many_layers_key_their_blocks_apart():
    first, second = _stage(0, (0, 1)), _stage(1, (2, 3))
    assert first.keys(HASHES) != second.keys(HASHES)
    # control: one stage's keys are the same in every process of it (the scheduler's, the worker's)
    assert _stage(0, (0, 1)).keys(HASHES) == first.keys(HASHES)
    assert _stage(1, (2, 3)).keys(HASHES) == second.keys(HASHES)


def test_one_stage_of_two_layer_partitions_keys_its_other_layers_apart():
    """``VLLM_PP_LAYER_PARTITION`` 8,8,8,8 and 7,8,9,8: stage 1 of 4 holds eight layers in both,
    not the same eight. Rank and size alone would give them one key."""
    assert _stage(1, range(8, 16), pp=4).keys(HASHES) != _stage(1, range(7, 15), pp=4).keys(HASHES)


def test_without_pipeline_parallelism_the_tag_names_no_stage():
    """Control: an engine of one stage keeps the tag (and the keys) it had."""
    tag = _stage(0, (0, 1), pp=1).format_tag
    assert "pipeline" not in tag
    with pytest.raises(ConfigError, match="stage 2 of 2"):
        _stage(2, (0, 1))


def test_a_stage_misses_another_stages_block_on_a_shared_tier(tmp_path):
    """Both stages' workers on one disk tier: stage 0 saves a block; stage 1 finds no block to
    load into its layers 2 and 3 (it loaded stage 0's layers 0 and 1 before). Control: another
    worker of stage 0 (a second process of it) loads the block, byte for byte."""
    from kvtier.integrations.vllm.metadata import BlockTransfer, KvtierMetadata, LoadJob, SaveJob
    from kvtier.integrations.vllm.worker_side import WorkerSide
    from kvtier.store.config import StoreConfig, build_store

    stages = [(0, (0, 1)), (1, (2, 3)), (0, (0, 1))]
    engines = [_stage(rank, layers) for rank, layers in stages]
    store = build_store(StoreConfig(host_bytes=0, disk_path=str(tmp_path), disk_bytes="64MiB", encrypt=False),
                        engines[0].layout)
    try:
        sides, caches = [], []
        for (_, layers), eng, seed in zip(stages, engines, (1, 2, 3)):
            gen = torch.Generator().manual_seed(seed)
            kv = {n: torch.randn(16, 2, 32, 64, generator=gen) for n in _layers(layers)}
            side = WorkerSide(eng, store)
            side.register(kv)
            sides.append(side)
            caches.append(kv)
        hashes = [b"p" * 32]
        sides[0].save(KvtierMetadata(saves=[SaveJob("a", hashes, [BlockTransfer(0, 0, [3, 4])])]))
        assert sides[0].flush(10)
        failed = sides[1]._load(LoadJob("b", hashes, [BlockTransfer(0, 0, [7, 8])], is_async=False))
        assert failed, "stage 1 loaded stage 0's block into its own layers"
        assert not sides[2]._load(LoadJob("c", hashes, [BlockTransfer(0, 0, [9, 10])], is_async=False))
        for name in _layers((0, 1)):
            assert torch.equal(caches[2][name][9:11], caches[0][name][3:5])
    finally:
        store.close(flush_timeout_s=0)


def test_each_pipeline_stage_serves_lookups_on_its_own_socket(monkeypatch, short_dir):
    """Every stage's TP rank 0 worker builds a connector: each serves lookups of its own store
    on its own socket (one socket for all: the second stage served none), and keys its own
    layers. The scheduler asks stage 0's."""
    import vllm.distributed.parallel_state as parallel_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvtier.integrations.vllm import connector as connector_mod
    from kvtier.integrations.vllm.lookup_service import LookupClient, socket_path

    monkeypatch.setenv("XDG_RUNTIME_DIR", short_dir)
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    connectors = []
    try:
        for rank, layers in ((0, (0, 1)), (1, (2, 3))):
            monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
            monkeypatch.setattr(parallel_state, "get_pp_group", lambda rank=rank: SimpleNamespace(rank_in_group=rank))
            config = _vllm_config(model_dtype=torch.float32, pp=2)
            config.kv_transfer_config = SimpleNamespace(
                engine_id="engine-pp", kv_role="kv_both", kv_load_failure_policy="recompute",
                kv_connector_extra_config={"block_tokens": 64, "host_bytes": "4MiB", "encrypt": False})
            connectors.append(connector_mod.KvtierConnector(config, KVConnectorRole.WORKER,
                                                            _kv_cache_config(spec, _layers(layers))))
        assert [c._lookup_server.serving for c in connectors] == [True, True]
        assert connectors[0]._lookup_server.path == socket_path("engine-pp")   # what the scheduler asks
        assert connectors[1]._lookup_server.path == socket_path("engine-pp", pp_rank=1)
        assert connectors[0].engine.format_tag != connectors[1].engine.format_tag
        keys = connectors[0].engine.keys(HASHES[:1])
        answer = LookupClient(socket_path("engine-pp")).lookup(keys)
        assert answer == 0   # reached stage 0's worker (an empty store)
    finally:
        for c in connectors:
            c.shutdown()


# == D3: lookup sockets named by a digest ========================================================
@pytest.mark.parametrize("ids", [("x" * 62 + "_dp0", "x" * 62 + "_dp1"), ("prefill.a", "prefilla"),
                                 ("engine/1", "engine1"), ("a", "A")],
                         ids=["truncated-dp-suffix", "dot", "slash", "case"])
def test_distinct_engine_ids_get_distinct_lookup_sockets(short_dir, ids):
    from kvtier.integrations.vllm.lookup_service import socket_path

    env = {"XDG_RUNTIME_DIR": short_dir}
    a, b = (socket_path(i, env=env) for i in ids)
    assert a != b, f"engine ids {ids} share the lookup socket {a}"
    assert socket_path(ids[0], env=env) == a   # control: one id, one socket


def test_two_data_parallel_ranks_with_a_long_engine_id_each_serve_their_own_lookups(monkeypatch, short_dir):
    """vLLM names data-parallel ranks ``<engine_id>_dp<rank>``; with a 60-character id both
    ranks got one socket: rank 1's scheduler was answered by rank 0's worker."""
    from kvtier.integrations.vllm.lookup_service import LookupClient, LookupServer, socket_path

    monkeypatch.setenv("XDG_RUNTIME_DIR", short_dir)
    base = "kvtier-worker-" + "a1b2c3d4" * 6
    servers = [LookupServer(socket_path(f"{base}_dp{r}"), lambda keys, r=r: 100 + r) for r in (0, 1)]
    try:
        assert [s.serving for s in servers] == [True, True], "rank 1's worker serves no lookups"
        assert LookupClient(socket_path(f"{base}_dp1")).lookup([b"k" * 32]) == 101
        assert LookupClient(socket_path(f"{base}_dp0")).lookup([b"k" * 32]) == 100   # control
    finally:
        for s in servers:
            s.close()


def test_the_socket_path_fits_a_unix_socket_whatever_the_engine_id(short_dir):
    from kvtier.integrations.vllm.lookup_service import MAX_SOCKET_PATH, socket_path

    runtime = os.path.join(short_dir, "r" * (54 - len(short_dir)))   # 55 bytes: the longest that fits
    os.mkdir(runtime)
    for engine_id in ("e", "x" * 1000, "ünïcode/../..\n"):
        path = socket_path(engine_id, env={"XDG_RUNTIME_DIR": runtime})
        assert path is not None and os.path.dirname(path) == os.path.join(runtime, "kvtier")
        assert len(os.fsencode(path)) == MAX_SOCKET_PATH, path
    os.mkdir(runtime + "r")
    with pytest.raises(ConfigError):   # one byte more does not fit
        socket_path("e", env={"XDG_RUNTIME_DIR": runtime + "r"})


def test_a_runtime_dir_too_long_for_a_socket_is_named_with_the_fix(tmp_path):
    """A long ``XDG_RUNTIME_DIR`` (or TMPDIR): the socket could not be bound there and the engine
    counted misses, the reason in one log line. Now a ConfigError says what to set."""
    from kvtier.integrations.vllm.lookup_service import socket_path

    long_dir = tmp_path / ("d" * 80)
    long_dir.mkdir()
    with pytest.raises(ConfigError, match="XDG_RUNTIME_DIR"):
        socket_path("e", env={"XDG_RUNTIME_DIR": str(long_dir)})


# == D4: the launcher reads the command line as vLLM does ========================================
KVTIER = json.dumps({"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                     "kv_role": "kv_both", "kv_connector_extra_config": {"host_bytes": "1GiB",
                                                                          "shutdown_flush_s": 2.5}})


def _timeouts(args):
    return [a for a in args if a.split("=")[0].replace("_", "-") == "--shutdown-timeout"]


@pytest.mark.parametrize("args", [
    ["serve", "m", "--kv-transfer-config", KVTIER],
    ["serve", "m", "--kv_transfer_config", KVTIER],
    ["serve", "m", f"--kv_transfer_config={KVTIER}"],
    ["serve", "m", "--kv-transfer-config.kv_connector", "KvtierConnector", "--kv-transfer-config.kv_role",
     "kv_both", "--kv-transfer-config.kv_connector_extra_config.shutdown_flush_s", "2.5"],
], ids=["hyphens", "underscores", "underscores=", "dotted"])
def test_serve_with_kvtier_gets_a_shutdown_grace_however_vllm_is_told(args):
    from kvtier.integrations.vllm.launcher import TEARDOWN_MARGIN_S, with_shutdown_grace

    out = with_shutdown_grace(list(args))
    assert out == [*args, "--shutdown-timeout", str(3 + TEARDOWN_MARGIN_S)]


def test_serve_with_kvtier_in_a_config_file_gets_a_shutdown_grace_unless_the_file_sets_one(tmp_path):
    from kvtier.integrations.vllm.launcher import with_shutdown_grace

    config = tmp_path / "serve.yaml"
    body = ("kv-transfer-config:\n  kv_connector: KvtierConnector\n"
            "  kv_connector_module_path: kvtier.integrations.vllm\n  kv_role: kv_both\n")
    config.write_text(body)
    assert _timeouts(with_shutdown_grace(["serve", "m", "--config", str(config)])) == ["--shutdown-timeout"]
    config.write_text(body + "shutdown-timeout: 0\n")
    args = ["serve", "m", "--config", str(config)]
    assert with_shutdown_grace(list(args)) == args


@pytest.mark.parametrize("flag", [["--shutdown_timeout", "0"], ["--shutdown-timeout", "0"],
                                  ["--shutdown_timeout=0"], ["--shutdown-timeout=30"]])
def test_a_shutdown_timeout_the_user_gave_is_kept(flag):
    from kvtier.integrations.vllm.launcher import with_shutdown_grace

    args = ["serve", "m", "--kv-transfer-config", KVTIER, *flag]
    assert with_shutdown_grace(list(args)) == args


def test_what_vllm_refuses_or_does_not_run_kvtier_is_left_alone():
    """Controls: no connector, another connector, a command vLLM itself refuses (a connector with
    no ``kv_role``), another subcommand: unchanged."""
    from kvtier.integrations.vllm.launcher import _parse_serve, with_shutdown_grace

    other = json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})
    refused = ["serve", "m", "--kv-transfer-config.kv_connector", "KvtierConnector"]
    assert _parse_serve(refused) is None     # vLLM's parser refuses it (and vLLM will say so)
    for args in (["serve", "m"], ["serve", "m", "--kv-transfer-config", other], refused,
                 ["bench", "serve", "--kv-transfer-config", KVTIER], []):
        assert with_shutdown_grace(list(args)) == args


@pytest.mark.parametrize("extra", ['{"shutdown_flush_s": NaN}', '{"shutdown_flush_s": "soon"}',
                                   '{"shutdown_flush_s": Infinity}', '{"shutdown_flush_s": 1e11}',
                                   '{"no_such_key": 1}'],
                         ids=["nan", "text", "infinity", "huge", "unknown"])
def test_a_bad_kvtier_setting_stops_the_launcher_with_the_connectors_message(extra, capsys):
    from kvtier.integrations.vllm.launcher import main, with_shutdown_grace

    args = ["serve", "m", "--kv-transfer-config",
            '{"kv_connector": "KvtierConnector", "kv_role": "kv_both", "kv_connector_extra_config": %s}' % extra]
    with pytest.raises(ConfigError) as err:
        with_shutdown_grace(list(args))
    assert main(list(args)) == 2      # before vLLM runs: no model loaded to learn it
    assert capsys.readouterr().err.strip() == f"kvtier: {err.value}"


# == D5: shutdown_flush_s is bounded =============================================================
@pytest.mark.parametrize("seconds", [1e11, 3600.5, 10 ** 12])
def test_a_shutdown_flush_beyond_an_hour_is_refused(seconds):
    with pytest.raises(ConfigError, match="shutdown_flush_s"):
        ConnectorConfig.from_extra_config({"shutdown_flush_s": seconds})


def test_the_longest_shutdown_flush_allowed_does_not_make_shutdown_raise():
    """At the bound, with a save still running: ``KvtierConnector.shutdown`` waits for it and
    releases the store (1e11 s made ``concurrent.futures.wait`` raise OverflowError)."""
    from kvtier.core.layout import KVLayout
    from kvtier.core.namespace import Namespace
    from kvtier.integrations.vllm import shared_store
    from kvtier.integrations.vllm.config import MAX_SHUTDOWN_FLUSH_S, EngineKV
    from kvtier.integrations.vllm.connector import KvtierConnector
    from kvtier.integrations.vllm.worker_side import WorkerSide
    from kvtier.store.config import StoreConfig

    config = ConnectorConfig.from_extra_config({"shutdown_flush_s": MAX_SHUTDOWN_FLUSH_S, "host_bytes": "4MiB",
                                                "encrypt": False})
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32", block_tokens=64)
    eng = EngineKV(Namespace("m", layout), page_tokens=32, hash_tokens=32, num_layers=2, format_tag="t")
    store = shared_store.acquire(StoreConfig(host_bytes="4MiB", encrypt=False), layout, flush_timeout_s=1)
    side = WorkerSide(eng, store)
    pending: Future = Future()   # a save still on the store's I/O pool at shutdown
    side._saves.append(pending)
    threading.Timer(0.5, pending.set_result, ([],)).start()
    connector = object.__new__(KvtierConnector)
    connector.config, connector.worker, connector.store, connector._lookup_server = config, side, store, None
    try:
        connector.shutdown()
    finally:
        if shared_store.live_stores():
            shared_store.close_all(why="test cleanup")
    assert connector.store is None and pending.done()


# == D6: an engine process's replies are matched to its commands =================================
FAKE_VLLM = {
    "vllm/__init__.py": textwrap.dedent("""
        import time

        class LLM:
            def __init__(self, **kw):
                self.resets = 0

            def reset_prefix_cache(self):
                self.resets += 1
                if self.resets == 1:
                    time.sleep(2.0)   # a slow command, once
                return True
        """),
    "vllm/config.py": "class KVTransferConfig:\n    def __init__(self, **kw):\n        pass\n",
}


@pytest.fixture
def fake_vllm(tmp_path):
    for rel, text in FAKE_VLLM.items():
        path = tmp_path / "fake" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path / "fake"), os.getcwd()])}


def test_after_a_timed_out_command_each_command_gets_its_own_reply(tmp_path, fake_vllm):
    """A late reply (``reset`` timed out) was the answer to the next command, and every later
    reply one behind: module-scoped engines fed later tests, a bench later measurements, wrong
    results. Control: the late reply did come, and a command in time gets its reply."""
    from kvtier.integrations.vllm.engine_proc import EngineDied, EngineProcess

    engine = EngineProcess({"model": "unused", "extra": None}, tmp_path / "engine.log", env=fake_vllm)
    try:
        engine.wait_ready(timeout=60)
        with pytest.raises(EngineDied, match="no reply"):
            engine.call(op="reset", timeout=0.3)
        got = engine.call(op="stats", timeout=20)
        assert "ok" not in got and "scheduler_error" in got, got
        assert engine.call(op="reset", timeout=20) == {"ok": True}   # in step: its own reply
        assert "scheduler_error" in engine.call(op="stats", timeout=20)
    finally:
        engine.close()
    assert "dropped the late reply to command 1" in (tmp_path / "engine.log").read_text()
    assert engine.proc.stdin.closed and engine.proc.stdout.closed and engine.proc.returncode == 0
