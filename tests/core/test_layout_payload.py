import numpy as np
import pytest

from kvtier.core.layout import KVLayout
from kvtier.core.payload import BlockMeta, checksum, header_mismatch, pack_header, unpack_header
from kvtier.errors import LayoutError


def test_layout_geometry():
    lay = KVLayout(num_layers=80, num_kv_heads=8, head_dim=128, dtype="bfloat16", block_tokens=256)
    assert lay.bytes_per_token == 327_680  # Llama-3-70B: 320 KiB per token
    assert lay.block_shape == (80, 2, 8, 256, 128)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(dtype="float64"), "unknown KV dtype"),
        (dict(num_layers=0), "num_layers must be a positive int"),
        (dict(kv_parts=3), "kv_parts"),
        (dict(tp_rank=2, tp_size=2), "tp_rank 2 is outside"),
        # a float rank passed validation, then broke the namespace root (AttributeError)
        (dict(tp_rank=0.0), "tp_rank must be an int, got 0.0"),
        (dict(tp_rank="0", tp_size=2), "tp_rank must be an int"),
    ],
)
def test_bad_layouts_name_the_problem(kw, match):
    base = dict(num_layers=2, num_kv_heads=2, head_dim=8)
    base.update(kw)
    with pytest.raises(LayoutError, match=match):
        KVLayout(**base)


def test_control_an_int_rank_keys_a_namespace():
    from kvtier.core.namespace import Namespace

    roots = {Namespace("m", KVLayout(2, 2, 8, tp_rank=r, tp_size=2)).root for r in (0, 1)}
    assert len(roots) == 2


def test_wrong_block_shape_names_the_mismatch(small_layout):
    good = np.zeros(small_layout.block_shape, np.float16)
    small_layout.check_block(good)
    bad = np.zeros((2, 2, 2, 8, 32), np.float16)
    with pytest.raises(LayoutError, match=r"needs shape \(2, 2, 2, 16, 32\)"):
        small_layout.check_block(bad)
    transposed = np.zeros((2, 2, 16, 2, 32), np.float16)
    with pytest.raises(LayoutError, match="needs"):
        small_layout.check_block(transposed)
    with pytest.raises(LayoutError, match="dtype float32"):
        small_layout.check_block(np.zeros((2, 2, 2, 16, 16), np.float32).reshape(2, 2, 2, 16, 16))


def test_header_round_trip_and_tamper_detection():
    payload = np.arange(1000, dtype=np.uint8)
    h = pack_header(b"k" * 32, payload.nbytes, checksum(payload), BlockMeta("float16", (2, 3), 16))
    parsed = unpack_header(h)
    assert parsed is not None and parsed.key == b"k" * 32 and parsed.shape == (2, 3)
    assert header_mismatch(parsed, b"k" * 32, 1000) is None
    assert "renamed" in header_mismatch(parsed, b"x" * 32, 1000)
    assert "reader expects" in header_mismatch(parsed, b"k" * 32, 999)
    for i in range(len(h)):
        flipped = bytearray(h)
        flipped[i] ^= 0x10
        assert unpack_header(flipped) is None, f"a flip at byte {i} went unnoticed"
    assert unpack_header(h[:-1]) is None
