"""kvtier: a context-memory tier for LLM inference.

The core (``kvtier.core``, ``kvtier.tiers``, ``kvtier.store``) needs numpy only;
torch, transformers and vLLM are imported lazily by ``kvtier.integrations``.
"""

from kvtier.core.keys import BlockKey, block_keys
from kvtier.core.layout import KVLayout
from kvtier.core.namespace import Namespace
from kvtier.errors import KvtierError, LayoutError

__all__ = ["BlockKey", "KVLayout", "KvtierError", "LayoutError", "Namespace", "block_keys"]
__version__ = "0.1.0"
