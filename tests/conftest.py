"""Shared fixtures. A pytest run that collects no test exits 5, which CI treats as failure."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvtier.core.layout import KVLayout
from kvtier.core.namespace import Namespace

# Every load in the suite (this process and the engines, servers and workers it starts)
# writes into KV memory poisoned with NaN first: a load that writes nothing then fails
# its test instead of passing on stale KV (kvtier/integrations/poison.py).
os.environ.setdefault("KVTIER_DEBUG_POISON", "1")


@pytest.fixture
def small_layout() -> KVLayout:
    # 2 layers x 2 parts x 2 heads x 16 tokens x 32 dims x fp16 = 8 KiB a block
    return KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16", block_tokens=16)


@pytest.fixture
def small_ns(small_layout) -> Namespace:
    return Namespace(model_id="test/tiny", layout=small_layout, weights_revision="r1", tenant="t0")


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def pytest_configure(config):
    # `make test` runs on pytest-xdist workers; which tests share a worker: tests/xdist_groups.py
    from tests import xdist_groups

    config.pluginmanager.register(xdist_groups, "kvtier-xdist-groups")
