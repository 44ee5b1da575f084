"""The launcher's shutdown grace (audit s27, second pass over the vLLM integration's edges).

* kvtier as one of vLLM's ``MultiConnector`` connectors gets the grace a top-level one gets (V1)
* a store setting the worker would refuse after the model load stops the launcher first (V2)
* with a multiprocess executor the workers, which own the store, get the flush's time too
* the scheduler in another process waits for a lookup as long as the worker's tiers may take

No vLLM engine is started; vLLM's own ``serve`` parser is built once (several seconds).
"""

from __future__ import annotations

import json
import math
import tempfile
from types import SimpleNamespace

import pytest

from tests.integrations.vllm.harness import skip_without_vllm

skip_without_vllm()

from kvtier.errors import ConfigError  # noqa: E402
from kvtier.integrations.vllm import launcher  # noqa: E402
from kvtier.integrations.vllm.config import LOOKUP_TIMEOUT_S, ConnectorConfig  # noqa: E402
from kvtier.integrations.vllm.launcher import (  # noqa: E402
    TEARDOWN_MARGIN_S,
    WORKER_GRACE_ENV,
    WORKER_MARGIN_S,
    shutdown_grace,
    with_shutdown_grace,
)

pytestmark = pytest.mark.timeout(120)


def _kvtier(extra: dict | None = None) -> dict:
    return {"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": extra or {}}


def _multi(*children: dict) -> dict:
    return {"kv_connector": "MultiConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": list(children)}}


NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}


def _serve(transfer: dict, *more: str) -> list[str]:
    return ["serve", "some/model", "--kv-transfer-config", json.dumps(transfer), *more]


def _timeout(args: list[str]) -> int:
    return int(args[args.index("--shutdown-timeout") + 1])


# -- V1: kvtier inside MultiConnector --------------------------------------------------------------
def test_kvtier_inside_a_multiconnector_gets_a_shutdown_grace():
    """vLLM's way to run kvtier beside another connector (NIXL for P/D): the kvtier child still owns
    a store whose DRAM-only blocks need the flush."""
    args = _serve(_multi(NIXL, _kvtier({"shutdown_flush_s": 6})))
    out = with_shutdown_grace(list(args))
    assert out == [*args, "--shutdown-timeout", str(6 + TEARDOWN_MARGIN_S)]


def test_the_largest_flush_of_several_kvtier_children_counts_nested_ones_too():
    args = _serve(_multi(_kvtier({"shutdown_flush_s": 2}), NIXL,
                         _multi(_kvtier({"shutdown_flush_s": 9.5}))))
    assert _timeout(with_shutdown_grace(list(args))) == 10 + TEARDOWN_MARGIN_S
    # a kvtier child without settings: the connector's default flush
    default = ConnectorConfig().shutdown_flush_s
    assert _timeout(with_shutdown_grace(_serve(_multi(NIXL, _kvtier())))) == math.ceil(default) + TEARDOWN_MARGIN_S


def test_a_bad_setting_of_a_kvtier_child_stops_the_launcher():
    with pytest.raises(ConfigError, match="shutdown_flush_s"):
        with_shutdown_grace(_serve(_multi(NIXL, _kvtier({"shutdown_flush_s": "soon"}))))
    with pytest.raises(ConfigError, match="kv_connector_extra_config"):
        with_shutdown_grace(_serve(_multi({**_kvtier(), "kv_connector_extra_config": [1]})))


def test_controls_a_top_level_kvtier_still_gets_its_grace_and_other_connectors_none():
    args = _serve(_kvtier({"shutdown_flush_s": 2.5}))
    assert with_shutdown_grace(list(args)) == [*args, "--shutdown-timeout", str(3 + TEARDOWN_MARGIN_S)]
    for transfer in (_multi(NIXL), _multi(), NIXL,
                     {**_multi(), "kv_connector_extra_config": {"connectors": "kvtier"}}):
        args = _serve(transfer)
        assert shutdown_grace(list(args)) == (args, None)
    given = _serve(_multi(_kvtier({"shutdown_flush_s": 6})), "--shutdown-timeout", "30")
    assert with_shutdown_grace(list(given)) == given     # the user's timeout is kept


# -- V2: store settings the worker would refuse after the model load --------------------------------
@pytest.mark.parametrize("extra", [{"eviction": "lfu"}, {"eviction": 3}, {"remote_url": "tcp://kv-0"},
                                   {"remote_url": "http://kv-0:7400"}],
                         ids=["unknown-policy", "policy-number", "no-port", "scheme"])
def test_store_settings_are_refused_when_the_config_is_read(extra):
    """``from_extra_config`` is what the launcher calls to stop a bad setting before vLLM loads the
    model; these passed it and failed only in the worker, after the load (eviction: a ValueError)."""
    with pytest.raises(ConfigError, match=next(iter(extra))):
        ConnectorConfig.from_extra_config(extra)


def test_the_launcher_stops_an_unknown_eviction_policy_before_vllm_starts(capsys):
    args = _serve(_kvtier({"eviction": "lfu"}))
    with pytest.raises(ConfigError, match="eviction='lfu'; choose one of"):
        with_shutdown_grace(list(args))
    assert launcher.main(list(args)) == 2
    assert "eviction='lfu'" in capsys.readouterr().err


def test_a_refused_remote_url_keeps_its_token_out_of_the_message():
    with pytest.raises(ConfigError) as err:
        ConnectorConfig.from_extra_config({"remote_url": "tcp://kv-0/ns?token=s3cret-t0ken"})
    assert "s3cret-t0ken" not in str(err.value) and "remote_url" in str(err.value)


def test_good_store_settings_still_pass():
    config = ConnectorConfig.from_extra_config({"eviction": "prefix-lru", "remote_url": "tcp://kv-0:7400",
                                                "remote_token": "t"})
    assert config.store.eviction == "prefix-lru" and config.store.remote_url == "tcp://kv-0:7400"
    args = _serve(_kvtier({"eviction": "lru", "remote_url": "unix:///run/kvtier.sock"}))
    assert "--shutdown-timeout" in with_shutdown_grace(list(args))


# -- the workers' grace under a multiprocess executor ----------------------------------------------
def test_the_workers_grace_covers_the_flush_below_the_engine_cores_timeout():
    """The engine core waits ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` (5 by default) for its workers,
    then SIGTERM, then SIGKILL 4 s later: a flush of 20 s would be cut at about 9."""
    args = _serve(_kvtier({"shutdown_flush_s": 20}))
    out, worker_s = shutdown_grace(list(args))
    assert worker_s == 20 + WORKER_MARGIN_S and worker_s < _timeout(out)
    multi = _serve(_multi(NIXL, _kvtier({"shutdown_flush_s": 7.2})))
    assert shutdown_grace(list(multi)).worker_s == 8 + WORKER_MARGIN_S
    # the user's own timeout: the workers still need the flush's time
    assert shutdown_grace([*args, "--shutdown-timeout", "60"]) == ([*args, "--shutdown-timeout", "60"],
                                                                    20 + WORKER_MARGIN_S)
    # 0: the immediate kill, asked for; no kvtier; not serve
    assert shutdown_grace([*args, "--shutdown-timeout", "0"]).worker_s is None
    assert shutdown_grace(_serve(NIXL)).worker_s is None
    assert shutdown_grace(["bench", "serve"]).worker_s is None


def _run_main(monkeypatch, args, env_value=None):
    """``launcher.main(args)``, vLLM's CLI replaced: what it would run with (argv, the variable)."""
    import vllm.entrypoints.cli.main as vllm_cli

    monkeypatch.setenv(WORKER_GRACE_ENV, "x")       # undone after the test, whatever main sets
    if env_value is None:
        monkeypatch.delenv(WORKER_GRACE_ENV)
    else:
        monkeypatch.setenv(WORKER_GRACE_ENV, env_value)
    monkeypatch.setattr("sys.argv", ["launcher"])
    seen = {}

    def fake_vllm_main():
        import os
        import sys

        seen.update(argv=list(sys.argv), env=os.environ.get(WORKER_GRACE_ENV))
        return 0

    monkeypatch.setattr(vllm_cli, "main", fake_vllm_main)
    assert launcher.main(list(args)) == 0
    return seen


def test_main_gives_the_workers_the_flushs_time_unless_the_variable_is_set(monkeypatch):
    args = _serve(_kvtier({"shutdown_flush_s": 12}))
    seen = _run_main(monkeypatch, args)
    assert seen == {"argv": ["vllm", *args, "--shutdown-timeout", str(12 + TEARDOWN_MARGIN_S)],
                    "env": str(12 + WORKER_MARGIN_S)}
    assert _run_main(monkeypatch, args, env_value="3")["env"] == "3"          # the user's is kept
    assert _run_main(monkeypatch, _serve(NIXL))["env"] is None                 # no kvtier: untouched


# -- the scheduler's lookup timeout ----------------------------------------------------------------
def test_the_lookup_timeout_follows_the_tiers_a_lookup_may_wait_on():
    assert ConnectorConfig().lookup_timeout_s == LOOKUP_TIMEOUT_S
    assert ConnectorConfig.from_extra_config({"disk_path": "/tmp/x"}).lookup_timeout_s == LOOKUP_TIMEOUT_S
    remote = ConnectorConfig.from_extra_config({"remote_url": "tcp://kv-0:7400", "remote_timeout_s": 5})
    assert remote.lookup_timeout_s == LOOKUP_TIMEOUT_S + 5
    both = ConnectorConfig.from_extra_config({"remote_url": "tcp://kv-0:7400", "remote_timeout_s": 86400,
                                              "mooncake_master": "m:50051", "mooncake_timeout_s": 3})
    assert both.lookup_timeout_s == LOOKUP_TIMEOUT_S + 86400 + 3      # finite: each at most a day


def test_a_scheduler_in_another_process_asks_with_that_timeout(monkeypatch):
    """No worker in this process: the scheduler asks the worker's lookup socket, and waits as long
    as the worker's lookup of a kvtier server may take."""
    import torch
    import vllm.distributed.parallel_state as parallel_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvtier.integrations.vllm import connector as connector_mod
    from kvtier.integrations.vllm.lookup_service import LookupClient
    from tests.integrations.vllm.test_integration_hostile import _kv_cache_config, _layers, _vllm_config

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(parallel_state, "get_pp_group", lambda: SimpleNamespace(rank_in_group=0))
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    with tempfile.TemporaryDirectory(dir="/tmp") as short:
        monkeypatch.setenv("XDG_RUNTIME_DIR", short)
        config = _vllm_config(model_dtype=torch.float32)
        config.kv_transfer_config = SimpleNamespace(
            engine_id="engine-lookup-timeout", kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"block_tokens": 64, "host_bytes": 0, "encrypt": False,
                                       "remote_url": "tcp://127.0.0.1:9", "remote_token": "t",
                                       "remote_timeout_s": 5})
        scheduler = connector_mod.KvtierConnector(config, KVConnectorRole.SCHEDULER,
                                                  _kv_cache_config(spec, _layers((0, 1))))
        try:
            client = scheduler.scheduler.lookup.__self__
            assert isinstance(client, LookupClient)
            assert client.timeout_s == LOOKUP_TIMEOUT_S + 5
        finally:
            scheduler.shutdown()
