"""``raise_open_file_limit``: the soft ``RLIMIT_NOFILE`` raised to the hard one, for the commands
that hold a descriptor per connection: ``kvtier serve`` (each client), ``kvtier route`` (each
client, each call to a worker, each event socket).

The soft default (1024 under systemd's ``LimitNOFILE=1024:524288`` and in many shells) is below
what their configured connection limits allow: at the limit every accept fails (EMFILE), and
uvloop then accepts and closes each new connection, so a client the config admits is reset
before it says a word, and nothing is logged.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)


def raise_open_file_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit; return the soft limit in
    force afterwards (unchanged where the kernel refuses: a hard limit of "unlimited" that it caps
    lower is logged, not raised). Process-wide: call it from a command's entry point."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        log.info("open-file limit left at %s (raising it to %s failed: %s)", soft, hard, exc)
        return soft
    return hard
