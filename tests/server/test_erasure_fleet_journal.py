"""An admin erase leaves no record of the erased blocks in the fleet journal
(``<state_dir>/fleet.journal``): their owner, namespace, session and client keys -- in clear
without encryption at rest, the keys a prompt-confirmation oracle -- are gone from the file once
the erase answers. Real processes: mooncake_master, a segment holder, ``kvtier serve``, clients
over TCP.

(s30 audit a2, D4: the records stayed until 4096 forgotten entries piled up or the next start.)"""

from __future__ import annotations

import pytest

from kvtier.cli.admin import admin_call
from tests.server.conftest import remote
from tests.server.harness import TOKENS
from tests.server.test_fleet_erase_and_stalls import _readable_in_fleet, _serve, cluster  # noqa: F401
from tests.server.test_fleet_restart import _put_spilling
from tests.tiers.mooncake_harness import mooncake_available

pytestmark = pytest.mark.skipif(mooncake_available() is not None, reason=str(mooncake_available()))


def test_an_erase_leaves_no_record_of_the_erased_blocks_in_the_fleet_journal(tmp_path, cluster):  # noqa: F811
    state = tmp_path / "state"
    journal = state / "fleet.journal"
    with _serve(tmp_path, cluster, state_dir=str(state)) as srv:
        erased_keys = _put_spilling(srv, "secret-project-ns")  # 12 blocks; DRAM holds 4, the fleet the rest
        kept_keys = _put_spilling(srv, "kept-ns")
        before = journal.read_bytes()
        in_fleet = [k for k in erased_keys if k in before]
        assert len(in_fleet) >= 8 and b"secret-project-ns" in before  # the control: their records are there
        reply = admin_call(srv.tcp_url, TOKENS["admin"], "erase", {"tenant": "acme", "namespace": "secret-project-ns"})
        assert reply["ok"] and reply["erased"] == 12 and "error" not in reply, reply
        after = journal.read_bytes()  # as the erase answered: no waiting
        left = [k for k in erased_keys if k in after]
        assert not left and b"secret-project-ns" not in after, (
            f"{len(left)} erased blocks' client keys (of {len(in_fleet)}) stay in the fleet journal")
        # the control: the other namespace's records, and its blocks, stay
        assert sum(k in after for k in kept_keys) >= 8
        acme = remote(srv, "acme", namespace="kept-ns")
        try:
            assert acme.lookup_prefix(kept_keys) == len(kept_keys)
        finally:
            acme.close()
        assert not any(_readable_in_fleet(cluster, "secret-project-ns", erased_keys))
