"""``kvtier demo --synthetic`` runs where torch is absent and reloads every byte it stored."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from kvtier.tiers.disk import DiskTier
from tests.tmpfs import mounted_tmpfs

CODE = """
import sys
for name in ("torch", "transformers"):
    sys.modules[name] = None  # importing them now raises ImportError
from kvtier.cli.main import main
sys.exit(main(["demo", "--synthetic", "--store-dir", sys.argv[1]]))
"""


def test_synthetic_round_trip_without_torch(tmp_path):
    result = subprocess.run([sys.executable, "-c", CODE, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "reload after a restart" in out and "NO" not in out
    assert "after the restart: 128/128 blocks, in ['disk']" in out


def test_the_demo_parent_process_does_not_import_torch():
    code = "import sys, kvtier.demo.runner, kvtier.cli.demo; print('torch' in sys.modules, 'transformers' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == ["False", "False"], result.stderr


def test_a_phase_above_its_limit_is_printed_with_a_warning_and_the_disk_limit_is_at_the_block_size(
        monkeypatch, tmp_path, capsys):
    """The "of limit" column was printed however far above 100 % it went (s30 a13 D9), and the disk
    limit was read in 2 MiB blocks, one request shape, while the phases read 512 KiB blocks."""
    from kvtier.demo import limits, synthetic

    disk_limits = []

    def disk_limit(*args, **kwargs):   # the real probe, its arguments noted
        disk_limits.append((args[1:], kwargs))
        return limits.disk_limit_gib_s(*args, **kwargs)

    # raising=False: the module had no such name before the fix (the test then fails on what it
    # prints, not on the patch); the probe's use is asserted below
    monkeypatch.setattr(synthetic, "disk_limit_gib_s", disk_limit, raising=False)
    monkeypatch.setattr(synthetic, "host_copy_gib_s", lambda nbytes: 0.01)   # a wrong (too slow) limit
    assert synthetic.run_synthetic(argparse.Namespace(store_dir=str(tmp_path / "a"))) == 0
    out = capsys.readouterr().out
    assert "WARNING: 'save a 4k-token context' of the host limit = " in out
    assert "WARNING: 'reload again (promoted)' of the host limit = " in out and "baseline is wrong" in out
    blocks = synthetic.CONTEXT_TOKENS // synthetic.LAYOUT.block_tokens
    assert disk_limits == [((synthetic.LAYOUT.block_nbytes,), {"in_flight": 1, "span_blocks": blocks})]
    # control: limits no phase can pass, no warning
    monkeypatch.setattr(synthetic, "host_copy_gib_s", lambda nbytes: 1e6)
    monkeypatch.setattr(synthetic, "disk_limit_gib_s", lambda *a, **k: 1e6, raising=False)
    assert synthetic.run_synthetic(argparse.Namespace(store_dir=str(tmp_path / "b"))) == 0
    assert "WARNING" not in capsys.readouterr().out


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_synthetic_json_is_one_strict_object_of_its_phases(tmp_path, capsys):
    """--json was ignored: a rich table on stdout (s30 a15 D4)."""
    from kvtier.demo import synthetic

    rc = synthetic.run_synthetic(argparse.Namespace(store_dir=str(tmp_path / "s"), json=True))
    out = capsys.readouterr().out
    summary = _strict(out)
    assert rc == 0 and summary["ok"] is True
    blocks = synthetic.N_BLOCKS
    assert [p["phase"] for p in summary["phases"]] == [
        "save a 4k-token context", "reload after eviction", "reload again (promoted)", "reload after a restart"]
    assert all(p["blocks"] == blocks and p["gib_s"] > 0 and p["shortfall"] is None for p in summary["phases"])
    assert [p["bytes_equal"] for p in summary["phases"]] == [None, True, True, True]
    assert summary["found_after_restart_blocks"] == blocks


@pytest.mark.parametrize("as_json", [True, False])
def test_loads_a_full_file_system_kept_short_are_not_posted_as_rates_or_corruption(tmp_path, capsys, as_json):
    """A 40 MiB tmpfs holds less than the 64 MiB context: a load of 0 blocks was posted with a GiB/s
    rate and "bytes equal NO" (s30 a15 D6)."""
    from kvtier.demo import synthetic

    with mounted_tmpfs(tmp_path / "small", "40m") as mnt:
        rc = synthetic.run_synthetic(argparse.Namespace(store_dir=str(mnt / "s"), json=as_json))
    out, err = capsys.readouterr()
    assert rc == 1 and "not stored" in err and "MiB free" in err, err
    if as_json:
        loads = _strict(out)["phases"][1:]
        assert all(p["blocks"] < synthetic.N_BLOCKS and p["shortfall"] == synthetic.DISK_FULL for p in loads), loads
        assert all(p["bytes_equal"] is not False for p in loads)
        assert all((p["gib_s"] is None) == (p["blocks"] == 0) for p in loads)
    else:
        row = next(line for line in out.splitlines() if "reload after eviction" in line)
        assert "NO" not in out and "not stored (disk full)" in row, out
        assert f"/{synthetic.N_BLOCKS}" in row


@pytest.fixture
def faulty_disk(monkeypatch):
    """The synthetic store's disk tier behind kvtier's fault injector; the faults to set."""
    from kvtier.demo import synthetic
    from kvtier.tiers.faulty import Faults, FaultyTier

    faults = Faults()
    monkeypatch.setattr(synthetic, "DiskTier", lambda path, capacity: FaultyTier(DiskTier(path, capacity), faults))
    return faults


def test_a_load_is_judged_only_on_the_blocks_it_loaded(tmp_path, capsys, faulty_disk):
    """Disk reads that fail part way: the rate over the blocks loaded, their bytes compared, the
    rest "not loaded" (the disk had room: not a full disk)."""
    from kvtier.demo import synthetic

    faulty_disk.get_error = 0.05
    rc = synthetic.run_synthetic(argparse.Namespace(store_dir=str(tmp_path / "s"), json=True))
    out, err = capsys.readouterr()
    disk_loads = [p for p in _strict(out)["phases"] if p["tier"] == "disk"]
    assert rc == 1 and "not (missing or unreadable" in err
    assert all(p["blocks"] < synthetic.N_BLOCKS and p["shortfall"] == synthetic.NOT_LOADED for p in disk_loads)
    assert all(p["bytes_equal"] is (True if p["blocks"] else None) for p in disk_loads), disk_loads
    assert all((p["gib_s"] is None) == (p["blocks"] == 0) for p in disk_loads)


def test_control_corrupt_loaded_bytes_are_still_said_no(tmp_path, capsys, faulty_disk):
    from kvtier.demo import synthetic

    faulty_disk.corrupt_read = 1.0   # every disk read reported OK with a bit flipped
    rc = synthetic.run_synthetic(argparse.Namespace(store_dir=str(tmp_path / "s")))
    out, err = capsys.readouterr()
    row = next(line for line in out.splitlines() if "reload after eviction" in line)
    assert rc == 1 and "NO" in row and "128/128" in row and "bytes other than those saved" in err
