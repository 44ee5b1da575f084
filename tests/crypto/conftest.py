import pytest

from kvtier.crypto.keyring import Keyring
from kvtier.crypto.providers import StaticMasterKey


@pytest.fixture
def keyring(tmp_path):
    return Keyring(StaticMasterKey(bytes(range(32))), tmp_path / "keys", refresh_s=0.0)
