"""A second preimage for XXH3-128, as any reader of a stored object could build one.

XXH3 (inputs over 240 bytes) runs eight 64-bit accumulators over 64-byte stripes; within a
1 KiB block, stripe ``s`` adds its word ``x`` of lane 0 to ``acc[1]`` and
``lo32(x ^ k_s) * hi32(x ^ k_s)`` to ``acc[0]``, where ``k_s`` comes from a public secret, and
only then are the accumulators scrambled. Replacing lane 0's words in four stripes of one block
by others with the same sum and the same sum of products leaves the hash unchanged: two
products made zero, the two others solved for. Milliseconds, no search worth the name.
"""

from __future__ import annotations

_M64 = (1 << 64) - 1
_M32 = (1 << 32) - 1
#: the first 32 bytes of XXH3's default secret (a constant of the algorithm): the key words of
#: lane 0 in stripes 0..3 (each stripe reads the secret 8 bytes further on)
_SECRET = bytes.fromhex("b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f")
_KEYS = [int.from_bytes(_SECRET[8 * s:8 * s + 8], "little") for s in range(4)]
_BLOCK = 1024
_STRIPE = 64


def _product(z: int) -> int:
    return (z & _M32) * (z >> 32)


def _solve(words: list[int]) -> list[int] | None:
    k0, k1, k2, k3 = _KEYS
    total = sum(words) & _M64
    products = sum(_product(x ^ k) for x, k in zip(words, _KEYS)) & _M64
    for a4 in range(1, 1 << 12):
        lo3 = (total - (k0 & _M32) - (k1 & _M32) - ((k3 & _M32) ^ a4)) & _M32
        a3 = lo3 ^ (k2 & _M32)
        if a3 == 0 or (products // a3) >> 32:
            continue
        b3 = products // a3
        rest = products - a3 * b3
        if rest % a4 or (rest // a4) >> 32:
            continue
        y1 = (k0 & _M32) | (0x5A5A5A5A << 32)             # lo32(y1 ^ k0) = 0: product 0
        y3 = k2 ^ (a3 | (b3 << 32))
        y4 = k3 ^ (a4 | ((rest // a4) << 32))
        y2 = (total - y1 - y3 - y4) & _M64                # lo32(y2 ^ k1) = 0 by the choice of a3
        return [y1, y2, y3, y4]
    return None


def same_xxh3_128(payload: bytes) -> bytes:
    """A payload other than ``payload`` (more than 2 KiB) with the same XXH3-128."""
    if len(payload) <= 2 * _BLOCK:
        raise ValueError("needs a payload longer than two XXH3 blocks")
    out = bytearray(payload)
    for block in range(len(payload) // _BLOCK - 1):        # never the last block (its tail is special)
        at = [block * _BLOCK + s * _STRIPE for s in range(4)]
        words = [int.from_bytes(out[i:i + 8], "little") for i in at]
        solved = _solve(words)
        if solved is not None and solved != words:
            for i, y in zip(at, solved):
                out[i:i + 8] = y.to_bytes(8, "little")
            return bytes(out)
    raise RuntimeError("no block of this payload could be solved")
