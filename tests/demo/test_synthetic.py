"""``kvtier demo --synthetic`` runs where torch is absent and reloads every byte it stored."""

from __future__ import annotations

import subprocess
import sys

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
