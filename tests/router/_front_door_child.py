"""A real router (default limits, one stand-in worker) in a process of its own with a low soft
RLIMIT_NOFILE (argv[1]): prints its URL, serves until stdin closes (test_front_door.py)."""

import asyncio
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.router.test_http import StandIn, start_router  # noqa: E402


async def main() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), hard))
    w = StandIn("w0")
    await w.start()
    router, runner, url = await start_router([w])
    print(url, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await runner.cleanup()
    await w.stop()


asyncio.run(main())
