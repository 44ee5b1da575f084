"""Children that do not outlive the process that started them.

A test run or a bench killed with SIGKILL cannot stop what it started: its servers and Mooncake
holders kept running (ppid 1) and skewed every benchmark after them. ``die_with_parent`` is
given to ``subprocess.Popen(preexec_fn=...)``: the kernel sends the child SIGTERM when its parent
goes (Linux ``PR_SET_PDEATHSIG``; elsewhere it does nothing).

The signal follows the *thread* that forked the child: start long-lived children from a thread
that lives as long as they should (the main thread, in practice).
"""

from __future__ import annotations

import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the child, before exec: ask for SIGTERM when the parent dies."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the caller's own stop() is all there is
        pass
