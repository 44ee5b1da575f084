"""``kvtier demo``: a real model loading the contexts it has seen instead of recomputing them.

The command only parses arguments; :mod:`kvtier.demo` does the work and the
model runs in worker processes, so neither this module nor the process that
prints the tables imports torch. ``--synthetic`` needs no torch at all.
"""

from __future__ import annotations


def positive_int(text: str) -> int:
    from kvtier.demo.preflight import positive_int as parse

    return parse(text)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="replay multi-turn agent sessions on a local random-weight Llama: TTFT with and without kvtier",
        description=(
            "Replays agent sessions (shared system prompt, tool outputs, user messages) on a "
            "random-weight Llama built locally, once without kvtier (recompute) and once with it "
            "(load), across a process restart. Prints per-turn TTFT, hits by tier, speedups and a summary."
        ),
    )
    parser.add_argument("--quick", action="store_true", help="a shorter replay (about a minute)")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object on stdout")
    parser.add_argument("--plot", metavar="FILE.png", help="draw TTFT per turn, with and without kvtier")
    parser.add_argument("--synthetic", action="store_true",
                        help="no model: store → evict → reload synthetic KV through host and disk tiers")
    parser.add_argument("--store-dir", metavar="DIR",
                        help="disk tier directory (default: a fresh one under the user cache dir, removed after)")
    parser.add_argument("--remote", metavar="URL",
                        help="use a kvtier server (tcp://host:port or unix:///path; token from $KVTIER_TOKEN) "
                             "as the shared tier instead of a local disk directory")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch threads in the engine processes (default: every core the machine leaves idle)")
    parser.set_defaults(func=run)


#: the flags of the real replay that ``--synthetic`` (no model, a local store only) has no use for
_REPLAY_ONLY = {"remote": "--remote", "plot": "--plot", "quick": "--quick", "threads": "--threads"}


def run(args) -> int:
    if args.synthetic:
        from kvtier.demo.synthetic import run_synthetic

        check_synthetic_flags(args)
        return run_synthetic(args)
    from kvtier.demo.runner import run_demo

    return run_demo(args)


def check_synthetic_flags(args) -> None:
    """ConfigError (one line, exit 2) naming the replay's flags given with ``--synthetic``: it ran
    without them (a --remote server never asked, no --plot drawn) and exited 0 as if it had not."""
    from kvtier.errors import ConfigError

    given = [flag for name, flag in _REPLAY_ONLY.items() if getattr(args, name, None) not in (None, False)]
    if given:
        raise ConfigError(f"--synthetic takes only --store-dir and --json, not {', '.join(given)} "
                          f"(those are the model replay's: drop --synthetic to use them)")
