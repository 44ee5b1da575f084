"""Which engines the connector keeps away from vLLM's CPU split-KV decode (cpu_windows.py):
those whose KV cache groups mix a sliding window with other windows or none. The engines
themselves are checked in test_architectures.py (a Gemma 3 turned off, a Qwen2 left alone)."""

from __future__ import annotations

from kvtier.integrations.vllm.cpu_windows import exposed


def test_a_group_mixing_a_window_with_full_layers_is_exposed():
    assert exposed([{64, None}])               # Gemma 3 with the hybrid manager off: one group
    assert exposed([{None}, {512, 4096}])      # two windows in one group: planned without either


def test_groups_that_each_share_one_window_are_not():
    assert not exposed([{None}])               # a model without windows
    assert not exposed([{64}])                 # every layer windowed alike (Mistral 7B)
    assert not exposed([{64}, {None}])         # the hybrid manager on: a group per window
    assert not exposed([])


def test_the_switch_is_read_again_where_vllms_env_cache_is_already_on():
    import os

    import pytest

    envs = pytest.importorskip("vllm.envs")
    from kvtier.integrations.vllm.cpu_windows import SWITCH, turn_off

    before = os.environ.pop(SWITCH, None)
    was_cached = envs._is_envs_cache_enabled()
    envs.enable_envs_cache()
    try:
        assert envs.VLLM_CPU_ATTN_SPLIT_KV, "vLLM's default: on"
        os.environ[SWITCH] = "0"
        assert envs.VLLM_CPU_ATTN_SPLIT_KV, "control: with the cache on, a changed variable is not read"
        del os.environ[SWITCH]
        assert turn_off() and not envs.VLLM_CPU_ATTN_SPLIT_KV
    finally:   # this process's environment and vLLM's cache as they were
        os.environ.pop(SWITCH, None)
        if before is not None:
            os.environ[SWITCH] = before
        envs.__getattr__.cache_clear()
        if not was_cached:
            envs.disable_envs_cache()
