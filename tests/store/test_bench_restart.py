"""``kvtier bench restart``: the embedded section end to end, small (the new process is real)."""

from kvtier.bench.restart import run


def test_bench_restart_recovers_every_block_in_a_new_process(tmp_path):
    result = run(blocks=12, block_kib=16, workdir=str(tmp_path), server=False)
    assert result["blocks"] == 12 and result["block_bytes"] == 16 << 10
    assert result["recovered_ratio"] == 1.0 and result["recovered_blocks"] == 12
    assert result["wrong_blocks"] == 0
    assert (result["flushed"], result["dropped"]) == (12, 0)
    assert result["close_flush_s"] > 0
    assert "server_recovered_ratio" not in result
    assert list(tmp_path.iterdir()) == []  # its temporary directory is gone
