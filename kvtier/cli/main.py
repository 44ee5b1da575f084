"""Entry point of the ``kvtier`` console script."""

from __future__ import annotations

import argparse
import importlib
import os
import select
import stat
import sys

# Command modules, each with ``register(subparsers)``. Heavy imports (torch,
# servers) happen inside the command functions, so ``kvtier --help`` is fast.
COMMAND_MODULES = [
    "kvtier.cli.bench",
    "kvtier.cli.demo",
    "kvtier.cli.plan",
    "kvtier.cli.simulate",
    "kvtier.cli.serve",
    "kvtier.cli.admin",
    "kvtier.cli.route",
    "kvtier.cli.top",
    "kvtier.cli.mooncake",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description="Context-memory tier for LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from kvtier.errors import KvtierError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()  # a reader gone shows here, not as a traceback at the interpreter's exit
        return status
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise  # a peer's socket closed: a real failure, with its traceback
        # The reader of stdout left (`| head -1`, a pager quit): what it wanted it has. Further
        # writes go nowhere, so that the flush at exit stays quiet too; 141 = 128 + SIGPIPE, what
        # a shell reports for a command ended by a closed pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except KvtierError as exc:
        # A caller mistake kvtier raises on purpose (a setting, an input, a layout, a tier that
        # cannot be used): its message names the fix, a traceback adds nothing (argparse's own
        # usage errors exit 2 the same way).
        print(f"kvtier {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Ctrl-C: the user's wish, not a fault; the commands clean up in their finally blocks.
        # 130 = 128 + SIGINT, what a shell reports for a process ended by Ctrl-C.
        print(f"kvtier {args.command}: interrupted", file=sys.stderr)
        return 130


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe or socket whose reader has closed its end (a file or terminal never
    is), which tells it from another socket's peer gone: poll reports it on stdout itself. A pipe's
    write end shows POLLERR; a socket's (systemd ``StandardOutput=socket``, inetd, socat, a
    socketpair) shows POLLHUP once its peer has closed, and no POLLERR."""
    try:
        fd = sys.stdout.fileno()
        gone = select.POLLERR | (select.POLLHUP if stat.S_ISSOCK(os.fstat(fd).st_mode) else 0)
    except (AttributeError, OSError, ValueError):  # replaced by an object without a descriptor
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & gone for _, events in poller.poll(0))


if __name__ == "__main__":
    sys.exit(main())
