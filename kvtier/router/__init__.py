"""``kvtier route``: the KV-aware, OpenAI-compatible front door to several engine workers."""
