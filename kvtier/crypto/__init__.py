"""Encryption of KV blocks off the GPU: chunked AES-256-GCM and envelope key management."""
