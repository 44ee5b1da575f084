"""Policies: small objects that decide and never do I/O."""
