"""The namespace a KV block belongs to, and the root of its key chain.

Everything that changes what the KV of a token sequence *is* must be in the
namespace: the model and its weights, the layout of the bytes, the tenant that
owns them and the adapter applied. Two namespaces that differ in any field have
unrelated roots, so their blocks can never be confused.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

from kvtier.core.framing import frame_int, frame_str
from kvtier.core.layout import KVLayout
from kvtier.errors import ConfigError

#: A remote store's shared key spaces are named ``shared/NAME``.
SHARED_PREFIX = "shared/"
#: A name in a remote store: a tenant's, a shared space's, a namespace's (matched whole: .fullmatch).
NAME_RULE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

# Tags are part of the on-disk key format: never reuse or renumber one.
_T_DOMAIN = 1
_T_MODEL = 2
_T_REVISION = 3
_T_DTYPE = 4
_T_LAYERS = 5
_T_KV_HEADS = 6
_T_HEAD_DIM = 7
_T_BLOCK_TOKENS = 8
_T_KV_PARTS = 9
_T_TP_RANK = 10
_T_TP_SIZE = 11
_T_TENANT = 12
_T_ADAPTER = 13
_T_SALT = 14

_DOMAIN = "kvtier/namespace/v1"


@dataclass(frozen=True, slots=True)
class Namespace:
    """Identity of a KV cache: model, weights, layout, tenant, adapter.

    ``salt`` is an extra per-request isolation value (vLLM's ``cache_salt``).
    """

    model_id: str
    layout: KVLayout
    weights_revision: str = ""
    tenant: str = ""
    adapter: str = ""
    salt: str = ""
    root: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ValueError("Namespace.model_id must not be empty")
        object.__setattr__(self, "root", self._compute_root())

    def _compute_root(self) -> bytes:
        lay = self.layout
        parts = [
            frame_str(_T_DOMAIN, _DOMAIN),
            frame_str(_T_MODEL, self.model_id),
            frame_str(_T_REVISION, self.weights_revision),
            frame_str(_T_DTYPE, lay.dtype),
            frame_int(_T_LAYERS, lay.num_layers),
            frame_int(_T_KV_HEADS, lay.num_kv_heads),
            frame_int(_T_HEAD_DIM, lay.head_dim),
            frame_int(_T_BLOCK_TOKENS, lay.block_tokens),
            frame_int(_T_KV_PARTS, lay.kv_parts),
            frame_int(_T_TP_RANK, lay.tp_rank),
            frame_int(_T_TP_SIZE, lay.tp_size),
            frame_str(_T_TENANT, self.tenant),
            frame_str(_T_ADAPTER, self.adapter),
            frame_str(_T_SALT, self.salt),
        ]
        return hashlib.sha256(b"".join(parts)).digest()

    def with_tenant(self, tenant: str) -> "Namespace":
        return Namespace(self.model_id, self.layout, self.weights_revision, tenant, self.adapter, self.salt)

    def with_salt(self, salt: str) -> "Namespace":
        return Namespace(self.model_id, self.layout, self.weights_revision, self.tenant, self.adapter, salt)


def check_namespace(ns: str) -> str:
    """A namespace a client of ``kvtier serve`` may name: its own (``NAME``) or a shared one
    (``shared/NAME``). The server's HELLO check and the clients' configuration both call this, so
    that a name every server would refuse is refused where it is configured, not at each call."""
    base = ns[len(SHARED_PREFIX):] if isinstance(ns, str) and ns.startswith(SHARED_PREFIX) else ns
    if not isinstance(base, str) or not NAME_RULE.fullmatch(base):
        raise ConfigError(f"namespace {ns!r}: use 1-64 letters, digits, '.', '_' or '-' (optionally after 'shared/')")
    return ns
