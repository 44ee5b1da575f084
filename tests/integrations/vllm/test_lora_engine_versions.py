"""On a real engine (CPU, one at a time): a LoRA request is saved under the adapter version vLLM
computes it with, and vLLM's prefix-cache resets reach kvtier through the block pool vLLM binds to
the connector (``bind_gpu_block_pool``).

* After an adapter is replaced in place, requests vLLM serves from its own prefix cache are not
  saved (it may give them the old version's pages) until that cache is reset; once it is, they are
  saved again. Were the reset not seen, saving would stop for good after the first replacement.
* An adapter retrained in place under the ``lora_int_id`` vLLM loaded it with is still computed
  with the old weights: none of that KV is stored under the new files' keys.
"""
from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest

from tests.integrations.vllm.harness import expected_hit, loaded_tokens, prompts, skip_without_vllm

skip_without_vllm()

from kvtier.integrations.transformers.models import random_lora_adapter  # noqa: E402

BLOCK = 64


@pytest.fixture(scope="module")
def lora_engine(engines, tiny_model, tmp_path_factory):
    """One engine with LoRA on a disk directory, without host tiers (every block comes from disk)."""
    disk = tmp_path_factory.mktemp("lora-disk")
    extra = {"block_tokens": BLOCK, "host_bytes": 0, "disk_path": str(disk), "disk_bytes": "256MiB"}
    engine = engines("lora", {"model": tiny_model, "extra": extra,
                              "engine_args": {"enable_lora": True, "max_lora_rank": 8}})
    engine.wait_ready()
    return SimpleNamespace(engine=engine)


def _adapter(name: str, lora_id: int, path) -> dict:
    return {"name": name, "id": lora_id, "path": str(path)}


@pytest.mark.timeout(400)
def test_a_request_vllm_serves_from_its_prefix_cache_after_a_reset_is_saved(lora_engine, tiny_model, tmp_path):
    engine = lora_engine.engine
    path = tmp_path / "adapters" / "customer-r"
    random_lora_adapter(tiny_model, path, seed=1)
    (old_prompt,) = prompts(1, 320, seed=51)
    (grown,) = prompts(1, 448, seed=52)
    first = grown[:320]
    engine.generate([old_prompt], lora=_adapter("customer-r", 41, path), max_tokens=4)
    shutil.rmtree(path)
    random_lora_adapter(tiny_model, path, seed=3)    # replaced in place, loaded under a new id
    v2 = _adapter("customer-r", 42, path)
    (mixed,) = engine.generate([old_prompt], lora=v2, max_tokens=4)
    assert mixed["num_cached_tokens"] > loaded_tokens(mixed) == 0, "control: vLLM served the old version's pages"
    assert engine.call(op="reset")["ok"]             # vLLM's prefix cache only; kvtier's store is kept
    engine.generate([first], lora=v2, max_tokens=4)
    (served,) = engine.generate([grown], lora=v2, max_tokens=4)
    assert served["num_cached_tokens"] >= 256 and loaded_tokens(served) == 0, \
        "control: vLLM served the first request's pages from its prefix cache"
    engine.call(op="flush")
    assert engine.call(op="reset")["ok"]
    (again,) = engine.generate([grown], lora=v2, max_tokens=4)
    assert loaded_tokens(again) == expected_hit(448, BLOCK), \
        "the request vLLM served from its prefix cache after the reset was not saved (the reset unseen?)"
    assert again["token_ids"] == served["token_ids"] and again["logprobs"] == served["logprobs"]


@pytest.mark.timeout(400)
def test_an_adapter_retrained_under_its_loaded_id_stores_none_of_the_old_weights_kv(lora_engine, tiny_model,
                                                                                   tmp_path):
    """vLLM reads an adapter's files only when it loads its id (or with ``load_inplace``): a request of
    the retrained adapter under the id already loaded is computed with the old weights."""
    engine = lora_engine.engine
    path = tmp_path / "adapters" / "customer-s"
    random_lora_adapter(tiny_model, path, seed=1)
    first, second = prompts(2, 320, seed=53)
    engine.generate([first], lora=_adapter("customer-s", 51, path), max_tokens=4)    # vLLM loads id 51: v1
    random_lora_adapter(tiny_model, path, seed=3)                                   # retrained in place
    (stale,) = engine.generate([second], lora=_adapter("customer-s", 51, path), max_tokens=4)
    assert loaded_tokens(stale) == 0
    engine.call(op="flush")
    assert engine.call(op="reset")["ok"]             # vLLM's prefix cache emptied, as by a restart
    (fresh,) = engine.generate([second], lora=_adapter("customer-s", 52, path), max_tokens=4)   # reads v2
    assert loaded_tokens(fresh) == 0, "the new version was served KV computed with the old weights"
    assert fresh["logprobs"] != stale["logprobs"], "control: the old weights computed otherwise"
    assert "not those vLLM loaded under its id 51" in engine.tail(100_000), "the operator is told"
