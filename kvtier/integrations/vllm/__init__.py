"""kvtier as a vLLM KV connector.

Load it with::

    --kv-transfer-config '{"kv_connector": "KvtierConnector",
                           "kv_connector_module_path": "kvtier.integrations.vllm",
                           "kv_role": "kv_both", "kv_connector_extra_config": {...}}'

``KvtierConnector`` is resolved lazily so that the helpers of this package
(``launcher``, ``lookup_service``, ``engine_proc``) import without vLLM.
"""

from __future__ import annotations

__all__ = ["KvtierConnector"]


def __getattr__(name: str):
    if name == "KvtierConnector":
        from kvtier.integrations.vllm.connector import KvtierConnector

        return KvtierConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
