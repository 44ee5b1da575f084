"""``python -m kvtier.server …``: the same as ``kvtier serve …`` (used by tests and benchmarks,
which then depend on nothing but the server)."""

from __future__ import annotations

import argparse
import sys

from kvtier.cli import serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier.server")
    sub = parser.add_subparsers(dest="command")
    serve.register(sub)
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
