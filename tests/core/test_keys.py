import numpy as np
import pytest

from kvtier.core.framing import frame_str
from kvtier.core.keys import block_keys, chain_external_hashes
from kvtier.core.layout import KVLayout
from kvtier.core.namespace import Namespace

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", block_tokens=4)


def ns(**kw) -> Namespace:
    base = dict(model_id="m", layout=LAYOUT, weights_revision="r", tenant="", adapter="", salt="")
    base.update(kw)
    return Namespace(**base)


def test_only_full_blocks_get_keys():
    assert len(block_keys(ns(), list(range(11)))) == 2
    assert block_keys(ns(), []) == []


def test_keys_chain_over_the_whole_prefix():
    a = block_keys(ns(), [1, 2, 3, 4, 5, 6, 7, 8])
    b = block_keys(ns(), [9, 2, 3, 4, 5, 6, 7, 8])
    assert a[1] != b[1], "block 1 must depend on block 0's tokens"
    assert block_keys(ns(), [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])[:2] == a


def test_continuing_a_chain_from_a_parent_equals_keying_from_the_start():
    tokens = list(range(20))
    full = block_keys(ns(), tokens)
    tail = block_keys(ns(), tokens[8:], parent=full[1])
    assert full[2:] == tail


def test_list_and_array_inputs_agree():
    tokens = list(range(40))
    assert block_keys(ns(), tokens) == block_keys(ns(), np.array(tokens, dtype=np.int64))


@pytest.mark.parametrize(
    "a,b",
    [
        # An adapter named like a tenant salt, and vice versa, must not collide.
        (dict(tenant="acme", adapter=""), dict(tenant="", adapter="acme")),
        (dict(adapter="x", salt=""), dict(adapter="", salt="x")),
        (dict(tenant="ab", adapter="c"), dict(tenant="a", adapter="bc")),
        (dict(model_id="m1", weights_revision=""), dict(model_id="m", weights_revision="1")),
        (dict(layout=LAYOUT), dict(layout=KVLayout(2, 2, 8, "bfloat16", 4))),
        (dict(layout=LAYOUT), dict(layout=KVLayout(2, 2, 8, "float16", 4, tp_rank=1, tp_size=2))),
    ],
)
def test_different_namespaces_never_share_keys(a, b):
    tokens = list(range(8))
    assert ns(**a).root != ns(**b).root
    assert set(block_keys(ns(**a), tokens)).isdisjoint(block_keys(ns(**b), tokens))


def test_shifted_token_boundaries_do_not_collide():
    # Same token stream cut into blocks at different places (block size 4 vs 2)
    # and a stream that only differs by where a block starts.
    tokens = list(range(8))
    ns2 = ns(layout=KVLayout(2, 2, 8, "float16", 2))
    assert set(block_keys(ns(), tokens)).isdisjoint(block_keys(ns2, tokens))
    assert block_keys(ns(), [0, 1, 2, 3, 4, 5, 6, 7])[1] != block_keys(ns(), [1, 2, 3, 4, 4, 5, 6, 7])[1]


def test_token_ids_out_of_range_are_rejected():
    with pytest.raises(ValueError, match="0 .. 2\\*\\*32-1"):
        block_keys(ns(), [-1, 0, 1, 2])


def test_framing_is_injective_on_field_boundaries():
    assert frame_str(1, "ab") + frame_str(2, "c") != frame_str(1, "a") + frame_str(2, "bc")


def test_external_hash_chains_are_namespaced():
    hashes = [b"h1", b"h2"]
    assert chain_external_hashes(ns(tenant="a"), hashes) != chain_external_hashes(ns(tenant="b"), hashes)
    assert chain_external_hashes(ns(), hashes)[:1] == chain_external_hashes(ns(), hashes[:1])
