"""A separate process writing disk-tier blocks whose content follows from the key.

Used by the kill test (SIGKILL at random moments) and the shared-directory test
(several writers of the same keys at once). Run from the repository root:

    python -m tests.tiers.disk_writer DIR --keys N --capacity BYTES [--loop | --once] [--batch B]

It prints ``ready`` once its DiskTier is open; with ``--wait`` it then waits
for a line on stdin, so that a test can start several writers at the same
moment. A read that returns OK with wrong bytes is written to ``DIR/WRONG``
(a killed writer cannot report through its exit status). ``--batch B`` (with
``--loop``) writes B distinct keys at a time with ``put_many`` (packed in one
extent) and reads them back with ``get_many``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

import numpy as np

from kvtier.tiers.base import Status
from kvtier.tiers.direct_io import aligned_buffer
from kvtier.tiers.disk import DiskTier


def key_of(i: int) -> bytes:
    return hashlib.sha256(b"disk-writer/%d" % i).digest()


def size_of(key: bytes) -> int:
    # 4 KiB .. 192 KiB, most not a whole number of pages: exercises the padded tail.
    return 4096 * (1 + key[0] % 48) + key[1] * 13


def content_of(key: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(0, 256, size_of(key), dtype=np.uint8)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--keys", type=int, default=100)
    p.add_argument("--capacity", type=int, default=1 << 30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loop", action="store_true", help="write random keys until killed")
    p.add_argument("--wait", action="store_true", help="wait for a stdin line before writing")
    p.add_argument("--batch", type=int, default=1, help="with --loop: keys per put_many")
    args = p.parse_args(argv)
    if args.batch > 1:
        return _loop_batches(args)

    tier = DiskTier(args.dir, args.capacity)
    rng = np.random.default_rng(args.seed)
    print("ready", flush=True)
    if args.wait:
        sys.stdin.readline()
    order = rng.permutation(args.keys)
    wrong = 0
    step = 0
    while True:
        i = int(order[step % args.keys]) if not args.loop else int(rng.integers(args.keys))
        key = key_of(i)
        want = content_of(key)
        if step % 2:  # half the puts from a page-aligned buffer (no staging copy)
            src = aligned_buffer(want.nbytes)
            src[:] = want
        else:
            src = want
        status = tier.put(key, src)
        if status not in (Status.OK, Status.FULL):
            print(f"put {i}: {status.name}", file=sys.stderr)
            return 2
        out = np.empty(want.nbytes, np.uint8)
        if tier.get(key, out) is Status.OK and not np.array_equal(out, want):
            wrong += 1
            with open(os.path.join(args.dir, "WRONG"), "a") as f:
                f.write(f"{i}\n")
        step += 1
        if not args.loop and step == args.keys:
            break
    # --once: read back every key, whoever wrote it
    for i in range(args.keys):
        key = key_of(i)
        out = np.empty(size_of(key), np.uint8)
        status = tier.get(key, out)
        if status is not Status.OK or not np.array_equal(out, content_of(key)):
            print(f"key {i}: {status.name}", file=sys.stderr)
            wrong += 1
    tier.close()
    return 1 if wrong else 0


def _loop_batches(args) -> int:
    """Write ``args.batch`` distinct random keys at a time with ``put_many`` until killed."""
    tier = DiskTier(args.dir, args.capacity)
    rng = np.random.default_rng(args.seed)
    print("ready", flush=True)
    while True:
        keys = [key_of(int(i)) for i in rng.choice(args.keys, size=args.batch, replace=False)]
        srcs = []
        for key in keys:
            src = aligned_buffer(size_of(key))
            src[:] = content_of(key)
            srcs.append(src)
        statuses = tier.put_many(keys, srcs, parents=[None] * len(keys))
        if any(s not in (Status.OK, Status.FULL) for s in statuses):
            print(f"put_many: {[s.name for s in statuses]}", file=sys.stderr)
            return 2
        outs = [aligned_buffer(size_of(key)) for key in keys]
        for key, out, status in zip(keys, outs, tier.get_many(keys, outs)):
            if status is Status.OK and not np.array_equal(out, content_of(key)):
                with open(os.path.join(args.dir, "WRONG"), "a") as f:
                    f.write(f"{key.hex()}\n")


if __name__ == "__main__":
    sys.exit(main())
