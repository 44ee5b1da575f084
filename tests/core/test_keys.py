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


# -- the fast keying path (numpy-framed blocks, a C loop when built) equals the definition --

from kvtier.core import keys as keys_module  # noqa: E402
from kvtier.core.keys import block_keys_reference, chain_external_hashes_reference  # noqa: E402

L16 = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", block_tokens=16)


@pytest.fixture(params=["c", "python"])
def keying_path(request, monkeypatch):
    """Run a test through the C loop and through the Python loop (the fallback without the extension)."""
    if request.param == "c":
        if keys_module._c_chain is None:
            pytest.skip("kvtier.core._chainhash is not built (python setup.py build_ext --inplace)")
    else:
        monkeypatch.setattr(keys_module, "_c_chain", None)
    return request.param


def test_keys_are_pinned_bytes(keying_path):
    # Computed with the one-hash-object-per-block code that stored every existing block:
    # a faster path that changed a byte would orphan every block already on disk or on a server.
    n = Namespace(model_id="m", layout=L16, weights_revision="r", tenant="t", adapter="", salt="")
    assert [k.hex() for k in block_keys(n, list(range(40)))] == [
        "b4a6ba661ae582b60489a11a6dd05a17d18b66edab0d76a581c0461493aca029",
        "d29d1f849945761a4e98f4467b0c247d06d29f7f909be57733687e3d5dc3d697",
    ]
    assert chain_external_hashes(n, [bytes([i]) * 32 for i in range(3)])[-1].hex() == (
        "eafd20b3f6bfd01312999c5a52de8a5b8ee9a1292d7845829f9c96b057f85739")


@pytest.mark.parametrize("block_tokens", [1, 4, 16, 256])
def test_fast_path_equals_the_reference_on_random_prompts(keying_path, block_tokens):
    rng = np.random.default_rng(block_tokens)
    n = ns(layout=KVLayout(2, 2, 8, "float16", block_tokens), tenant="acme")
    for length in [0, block_tokens - 1, block_tokens, 3 * block_tokens + 1, 1000, 4096 + block_tokens // 2]:
        prompt = rng.integers(0, 2**32, length, dtype=np.uint64)  # the whole token range
        want = block_keys_reference(n, prompt)
        assert len(want) == length // block_tokens  # a partial last block has no key
        assert block_keys(n, prompt) == want
        assert block_keys(n, prompt.tolist()) == want
        if want:
            cut = len(want) // 2 * block_tokens
            assert block_keys(n, prompt[cut:], parent=want[cut // block_tokens - 1] if cut else None) == \
                want[cut // block_tokens:]


def test_fast_external_chain_equals_the_reference(keying_path):
    rng = np.random.default_rng(7)
    n = ns(tenant="acme")
    digests = [rng.bytes(32) for _ in range(300)]  # vLLM's sha256 block hashes
    root = chain_external_hashes_reference(n, [b"page-format"])[0]
    assert chain_external_hashes(n, digests, parent=root) == chain_external_hashes_reference(n, digests, parent=root)
    mixed = [b"a", b"bc", rng.bytes(32)]  # sizes differ: the general path
    assert chain_external_hashes(n, mixed) == chain_external_hashes_reference(n, mixed)
    assert chain_external_hashes(n, []) == []


def test_a_parent_that_is_not_a_key_is_refused(keying_path):
    with pytest.raises(ValueError, match="32 bytes"):
        block_keys(ns(), list(range(8)), parent=b"short")


# -- the C path and the fallback agree on every input either takes (audit s26, D6) -------------
def test_a_bytes_like_parent_gives_the_same_keys_on_both_paths(keying_path):
    """D6a: the fallback raised TypeError for a memoryview parent (and numpy's for an array)."""
    n = ns(tenant="acme")
    tokens = list(range(12))
    parent = block_keys(n, list(range(4)))[0]
    want = block_keys_reference(n, tokens, parent=parent)
    assert len(want) == 3 and block_keys(n, tokens, parent=parent) == want   # control: bytes
    for like in (memoryview(parent), bytearray(parent), np.frombuffer(parent, np.uint8),
                 np.frombuffer(parent, np.uint32)):     # 8 items, 32 bytes: read as its bytes
        assert block_keys(n, tokens, parent=like) == want
        assert chain_external_hashes(n, [b"h" * 32], parent=like) == \
            chain_external_hashes_reference(n, [b"h" * 32], parent=parent)


def test_an_int_parent_is_refused_not_read_as_zero_bytes(keying_path):
    # bytes(32) is 32 zero bytes: a parent key made up from an int
    for call in (lambda: block_keys(ns(), list(range(8)), parent=32),
                 lambda: chain_external_hashes(ns(), [b"h"], parent=32)):
        with pytest.raises(TypeError):
            call()


def test_external_hashes_from_an_iterator_give_the_same_keys_on_both_paths(keying_path):
    """D6b: with the extension, a one-shot iterator of one-sized hashes raised TypeError, and one of
    mixed sizes returned [] (the sizes were read off it before it was chained)."""
    same = [bytes([i]) * 32 for i in range(3)]
    mixed = [b"a", b"bc", b"d" * 32]
    for hashes in (same, mixed):
        want = chain_external_hashes_reference(ns(), hashes)
        assert len(want) == 3 and chain_external_hashes(ns(), hashes) == want   # control: a list
        assert chain_external_hashes(ns(), iter(hashes)) == want
        assert chain_external_hashes(ns(), (h for h in hashes)) == want
        assert chain_external_hashes_reference(ns(), iter(hashes)) == want


def test_an_external_hash_is_framed_with_its_byte_count(keying_path):
    """A uint32 array's len() counts items: it was framed as 8 bytes long (reference) or failed to
    reshape (C path). Now it is its 32 bytes, whatever holds them."""
    digests = [bytes([i]) * 32 for i in range(3)]
    want = chain_external_hashes_reference(ns(), digests)
    as_arrays = [np.frombuffer(d, np.uint32) for d in digests]
    assert chain_external_hashes(ns(), as_arrays) == want
    assert chain_external_hashes_reference(ns(), as_arrays) == want
    assert chain_external_hashes(ns(), [memoryview(d) for d in digests]) == want


def test_an_external_chain_refuses_a_parent_that_is_not_a_key(keying_path):
    """D6c: a 31-byte parent was chained under a parent frame head that says 32 bytes."""
    root = chain_external_hashes(ns(), [b"page-format"])[0]
    assert chain_external_hashes(ns(), [b"h" * 32], parent=root)   # control: a key is taken
    for short in (b"s" * 31, b"s" * 33, b""):
        for chain in (chain_external_hashes, chain_external_hashes_reference):
            with pytest.raises(ValueError, match="32 bytes"):
                chain(ns(), [b"h" * 32], parent=short)
        with pytest.raises(ValueError, match="32 bytes"):
            block_keys_reference(ns(), list(range(8)), parent=short)
