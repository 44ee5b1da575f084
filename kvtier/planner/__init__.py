"""Sizing answers with their formulas: ``models`` (KV bytes and FLOPs per model),
``capacity`` (bytes for a user population), ``costmodel`` and ``hardware`` (prefill and
decode seconds, calibrated or roofline), ``workers`` (SLA worker counts)."""
