"""Entry point of the ``kvtier`` console script."""

from __future__ import annotations

import argparse
import importlib
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
        return int(args.func(args) or 0)
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


if __name__ == "__main__":
    sys.exit(main())
