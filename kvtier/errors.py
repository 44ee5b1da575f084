"""The small exception hierarchy of kvtier.

Tiers never raise for a missing, corrupt or foreign block: those are misses
reported through :class:`kvtier.tiers.base.Status`. Exceptions are for caller
mistakes (wrong layout, bad configuration) that retrying cannot fix.
"""


class KvtierError(Exception):
    """Base class of every error kvtier raises on purpose."""


class LayoutError(KvtierError, ValueError):
    """A buffer does not match the KV layout it is stored or loaded under."""


class ConfigError(KvtierError, ValueError):
    """A configuration value is invalid; the message names the fix."""


class TierError(KvtierError, OSError):
    """A tier could not be used at all (not a per-block failure)."""
