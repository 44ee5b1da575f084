"""A command whose stdout reader leaves early (``| head -1``, a pager quit) ends quietly, exit 141
(128 + SIGPIPE, as a shell reports it), not with a BrokenPipeError traceback (audit s32 a7 D5).
Made deterministic: the read end of the child's stdout pipe is closed before the child writes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CAPACITY = [sys.executable, "-m", "kvtier.cli.main", "plan", "capacity", "--model", "llama-3-8b", "--users", "1",
            "--context-tokens", "1"]


def _run_with_reader_gone(argv: list[str]) -> subprocess.CompletedProcess:
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(argv, stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120,
                              env={**os.environ, "PYTHONWARNINGS": "ignore"})
    finally:
        os.close(write_end)


@pytest.mark.parametrize("json_flag", [[], ["--json"]], ids=["table written in the command", "json flushed at its end"])
def test_a_reader_gone_ends_the_command_quietly(json_flag):
    done = _run_with_reader_gone(CAPACITY + json_flag)
    assert done.returncode == 141 and done.stderr == "", done.stderr[-2000:]


def test_control_with_its_reader_the_command_prints_and_exits_0():
    done = subprocess.run(CAPACITY + ["--json"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0 and done.stdout.startswith('{"model": "llama-3-8b"'), done.stderr[-2000:]


def test_a_broken_pipe_elsewhere_is_not_taken_for_stdouts_reader(monkeypatch, tmp_path):
    """A peer's socket closing is a real failure, kept with its traceback: only a stdout whose
    reader left counts, never a file or a pipe still read."""
    from kvtier.cli.main import _stdout_reader_gone

    with open(tmp_path / "out.txt", "w") as file:
        monkeypatch.setattr(sys, "stdout", file)
        assert not _stdout_reader_gone()
    read_end, write_end = os.pipe()
    with os.fdopen(write_end, "w") as pipe:
        monkeypatch.setattr(sys, "stdout", pipe)
        assert not _stdout_reader_gone()
        os.close(read_end)
        assert _stdout_reader_gone()
        monkeypatch.undo()
