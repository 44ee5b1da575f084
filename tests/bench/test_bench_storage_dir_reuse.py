"""``bench storage --dir D`` can be run again on the same D (audit s32 a7 D1): the encrypted bench's
key store, bound to each run's random master key, was left in D/keys, and the next run with the
same --dir was refused ("the master key does not match the key store")."""

from __future__ import annotations

import json
import os

import pytest

from kvtier.cli.main import main

TINY = ["--block-mib", "0.25", "--blocks", "2", "--runs", "1", "--json"]


@pytest.mark.parametrize("encrypt", [["--encrypt"], []])
def test_a_second_run_with_the_same_dir_runs_and_neither_leaves_anything_there(encrypt, tmp_path, capsys):
    mine = tmp_path / "mine.txt"
    mine.write_text("the user's own file")
    runs = []
    for _ in range(2):
        rc = main(["bench", "storage", "--tier", "disk", "--dir", str(tmp_path), *TINY, *encrypt])
        runs.append((rc, capsys.readouterr()))
    assert [rc for rc, _ in runs] == [0, 0], runs[1][1].err
    assert sorted(os.listdir(tmp_path)) == ["mine.txt"]  # each run's files went away with it
    assert mine.read_text() == "the user's own file"
    for _, captured in runs:
        assert os.path.dirname(json.loads(captured.out)["dir"]) == str(tmp_path)  # inside --dir, as asked
