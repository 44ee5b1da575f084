"""The worker's format tag reaches the scheduler through vLLM's connector handshake
(``KvtierConnector.get_handshake_metadata``), audit s29 a3:

* only the worker the scheduler reads, pipeline stage 0 and TP rank 0, hands it over: vLLM's
  MultiConnector forwards every worker's handshake to each sub-connector, and those without one
  of their own (OffloadingConnector, LMCache, Mooncake) refuse a stage above 0: the engine did
  not start with pipeline parallelism and kvtier beside one of them;
* two kvtier connectors in one MultiConnector, or kvtier in a nested one, hand it over without
  asking each other back (every worker died of RecursionError);
* beside a connector that has a handshake of its own (NIXL's), kvtier still gives way.

Real worker-side KvtierConnectors (vLLM's parallel state stands in for a started engine's, as in
``test_integration_hostile``) inside vLLM's MultiConnector; no engine.
"""
from __future__ import annotations

import shutil
import tempfile
from types import SimpleNamespace

import pytest
import torch

from tests.integrations.vllm.harness import skip_without_vllm

skip_without_vllm()

from tests.integrations.vllm.test_integration_hostile import _kv_cache_config, _layers, _vllm_config  # noqa: E402


@pytest.fixture
def workers(monkeypatch):
    """``make(pp_rank, tp_rank, name)``: a worker-side KvtierConnector of a 2-stage, 2-rank engine
    (its own engine id, so that each has its own store and lookup socket); all shut down at the end."""
    import vllm.distributed.parallel_state as parallel_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvtier.integrations.vllm.connector import KvtierConnector

    short_dir = tempfile.mkdtemp(prefix="k", dir="/tmp")   # lookup sockets: pytest's tmp_path is too long
    monkeypatch.setenv("XDG_RUNTIME_DIR", short_dir)
    spec = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=32, dtype=torch.float32)
    made = []

    def make(pp_rank: int, tp_rank: int, name: str = "") -> KvtierConnector:
        monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: tp_rank)
        monkeypatch.setattr(parallel_state, "get_pp_group", lambda: SimpleNamespace(rank_in_group=pp_rank))
        config = _vllm_config(model_dtype=torch.float32, tp=2, pp=2)
        config.kv_transfer_config = SimpleNamespace(
            engine_id=f"hs{name}{pp_rank}{tp_rank}", kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"block_tokens": 64, "host_bytes": "4MiB", "encrypt": False})
        layers = (0, 1) if pp_rank == 0 else (2, 3)
        made.append(KvtierConnector(config, KVConnectorRole.WORKER, _kv_cache_config(spec, _layers(layers))))
        return made[-1]

    yield make
    for connector in made:
        connector.shutdown()
    shutil.rmtree(short_dir, ignore_errors=True)


def _multi(*connectors):
    """vLLM's MultiConnector over ``connectors`` (built already: its own constructor builds them
    from a config)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    multi = object.__new__(MultiConnector)
    multi._connectors = list(connectors)
    return multi


def _without_handshake():
    """vLLM's OffloadingConnector (no handshake of its own: the base class's methods), stateless."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    connector = object.__new__(OffloadingConnector)
    connector.connector_worker = connector.connector_scheduler = None
    return connector


def _handshake(monkeypatch, group):
    """What a worker whose KV transfer group is ``group`` hands vLLM (``get_handshake_metadata``)."""
    import vllm.distributed.kv_transfer.kv_transfer_state as state

    monkeypatch.setattr(state, "_KV_CONNECTOR_AGENT", group)
    return group.get_handshake_metadata()


def test_only_the_worker_the_scheduler_reads_hands_its_tag_over(workers, monkeypatch):
    """What EngineCore gathers from the four workers of a PP=2, TP=2 engine (vLLM's worker keys
    each non-None answer ``(pp_rank, tp_rank)``) reaches every sub-connector of the scheduler's
    MultiConnector; the one without a handshake must accept it."""
    from kvtier.integrations.vllm.metadata import KvtierHandshake

    gathered, tags = {}, {}
    for pp_rank in (0, 1):
        for tp_rank in (0, 1):
            kvtier = workers(pp_rank, tp_rank)
            tags[(pp_rank, tp_rank)] = kvtier.engine.format_tag
            answer = _handshake(monkeypatch, _multi(kvtier, _without_handshake()))
            if answer is not None:
                gathered[(pp_rank, tp_rank)] = answer
    _multi(_without_handshake()).set_xfer_handshake_metadata_pp_aware(gathered)   # the engine starts
    assert list(gathered) == [(0, 0)]
    assert isinstance(gathered[(0, 0)], KvtierHandshake) and gathered[(0, 0)].format_tag == tags[(0, 0)]


def test_two_kvtier_connectors_hand_the_tag_over_without_asking_each_other(workers, monkeypatch):
    first, second = workers(0, 0, "a"), workers(0, 0, "b")
    answer = _handshake(monkeypatch, _multi(first, second))
    assert answer is not None and answer.format_tag == first.engine.format_tag


def test_kvtier_in_a_nested_multiconnector_hands_the_tag_over(workers, monkeypatch):
    kvtier = workers(0, 0)
    answer = _handshake(monkeypatch, _multi(_multi(kvtier, _without_handshake()), _without_handshake()))
    assert answer is not None and answer.format_tag == kvtier.engine.format_tag


class _ConnectorWithHandshake:
    """Stands for NIXL's connector, which needs its own handshake to reach its scheduler."""

    marker = SimpleNamespace(name="nixl-like")

    def get_handshake_metadata(self):
        return self.marker


@pytest.mark.parametrize("nested", [False, True], ids=["beside", "nested"])
def test_kvtier_gives_way_to_a_connector_with_a_handshake_of_its_own(workers, monkeypatch, nested):
    other = _ConnectorWithHandshake()
    kvtier = workers(0, 0)
    group = _multi(kvtier, _multi(other) if nested else other)
    assert _handshake(monkeypatch, group) is other.marker
    assert kvtier.get_handshake_metadata() is None
