"""The weights identity of a transformers model is exact, and a restart does not rehash.

No torch needed: a real safetensors shard written with ``safetensors.numpy``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import sys

import numpy as np
import pytest

from kvtier.integrations.transformers.namespace import weights_identity
from kvtier.integrations.transformers.weights_hash import WeightsDigests, default_cache_path

safetensors_numpy = pytest.importorskip("safetensors.numpy")

SHARD_BYTES = 64 << 20
CHANGED_BYTES = 4_000_000
# The sampled identity this replaces read 16 windows of 64 KiB, evenly spaced over a shard's data.
OLD_SAMPLES, OLD_SAMPLE_BYTES = 16, 64 << 10


def _write_shard(directory, seed: int = 0):
    directory.mkdir(parents=True, exist_ok=True)
    weights = np.random.default_rng(seed).standard_normal(SHARD_BYTES // 4, dtype=np.float32)
    path = directory / "model.safetensors"
    safetensors_numpy.save_file({"model.layers.0.mlp.weight": weights.reshape(4096, -1)}, str(path))
    return path


def _data_start(path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def _between_old_windows(path) -> int:
    """Where CHANGED_BYTES fit between two of the old sampled windows (after window 3)."""
    start = _data_start(path)
    span = os.path.getsize(path) - start
    window = [start + (span - OLD_SAMPLE_BYTES) * i // (OLD_SAMPLES - 1) for i in range(OLD_SAMPLES)]
    offset = window[3] + OLD_SAMPLE_BYTES
    assert offset + CHANGED_BYTES <= window[4], "the change must miss every old window"
    return offset


def _chunked_sha256(data: bytes) -> str:
    """The documented file digest, computed independently: SHA-256 of the size and each 64 MiB chunk's SHA-256."""
    top = hashlib.sha256(len(data).to_bytes(8, "little"))
    for off in range(0, len(data), 64 << 20):
        top.update(hashlib.sha256(data[off : off + (64 << 20)]).digest())
    return top.hexdigest()


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def test_4mb_changed_between_the_old_sample_windows_changes_the_identity(tmp_path):
    base = _write_shard(tmp_path / "base")
    tuned_dir = tmp_path / "tuned"
    tuned_dir.mkdir()
    tuned = tuned_dir / base.name
    shutil.copyfile(base, tuned)
    offset = _between_old_windows(tuned)
    with open(tuned, "r+b") as f:  # a partial fine-tune: 4 MB of one tensor, nothing else
        f.seek(offset)
        f.write(np.random.default_rng(1).integers(0, 256, CHANGED_BYTES, dtype=np.uint8).tobytes())
    assert os.path.getsize(tuned) == os.path.getsize(base)

    assert weights_identity(tuned_dir) != weights_identity(base.parent)
    # positive controls: the same files give the same identity, wherever they are
    assert weights_identity(base.parent) == weights_identity(base.parent)
    copy_dir = tmp_path / "copy"
    copy_dir.mkdir()
    shutil.copyfile(base, copy_dir / base.name)
    assert weights_identity(copy_dir) == weights_identity(base.parent)


def test_a_restart_does_not_open_an_unchanged_weight_file(tmp_path):
    shard = _write_shard(tmp_path / "model")
    first = WeightsDigests()
    identity = weights_identity(shard.parent, digests=first)
    assert first.files_hashed == 1 and first.bytes_hashed == os.path.getsize(shard)

    cache = default_cache_path()
    assert cache == tmp_path / "xdg" / "kvtier" / "weights-sha256.json"
    assert stat.S_IMODE(cache.stat().st_mode) == 0o600
    entry = json.loads(cache.read_text())["entries"][os.path.realpath(shard)]
    assert entry["digest"] == _chunked_sha256(shard.read_bytes())
    assert entry["size"] == os.path.getsize(shard) and entry["ino"] == os.stat(shard).st_ino

    # a "restart": a new object over the same cache file; the shard must not even be opened
    opened: list[str] = []
    watching = [True]

    def audit(event, args):
        if watching[0] and event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            opened.append(os.fsdecode(args[0]))

    sys.addaudithook(audit)  # (hooks cannot be removed: this one stops recording below)
    try:
        again = WeightsDigests()
        assert weights_identity(shard.parent, digests=again) == identity
    finally:
        watching[0] = False
    assert again.files_hashed == 0 and again.bytes_hashed == 0
    assert not [p for p in opened if os.path.realpath(p) == os.path.realpath(shard)], opened


def test_a_file_rewritten_in_place_with_its_old_mtime_is_hashed_again(tmp_path):
    shard = _write_shard(tmp_path / "model")
    identity = weights_identity(shard.parent, digests=WeightsDigests())
    before = os.stat(shard)
    offset = _between_old_windows(shard)
    with open(shard, "r+b") as f:
        f.seek(offset)
        f.write(b"\x7f" * 4096)
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))  # same path, inode, size and mtime
    after = os.stat(shard)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    digests = WeightsDigests()
    assert weights_identity(shard.parent, digests=digests) != identity  # its ctime moved: not trusted
    assert digests.files_hashed == 1


def test_a_cache_file_others_can_write_is_ignored(tmp_path):
    shard = _write_shard(tmp_path / "model")
    identity = weights_identity(shard.parent, digests=WeightsDigests())
    cache = default_cache_path()
    doc = json.loads(cache.read_text())
    doc["entries"][os.path.realpath(shard)]["digest"] = "0" * 64  # a forged digest...
    cache.write_text(json.dumps(doc))
    os.chmod(cache, 0o666)  # ...in a file anyone may write
    digests = WeightsDigests()
    assert weights_identity(shard.parent, digests=digests) == identity
    assert digests.files_hashed == 1
    assert stat.S_IMODE(cache.stat().st_mode) == 0o600  # rewritten as this user's alone


def test_not_a_safetensors_file_is_a_clear_error(tmp_path):
    from kvtier.errors import ConfigError

    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ConfigError, match="not a safetensors file"):
        weights_identity(tmp_path / "bad", digests=WeightsDigests(False))
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        weights_identity(tmp_path, digests=WeightsDigests(False))
