"""``python -m tests.planner.zmq_standin serve MODEL …``: a worker for the local launcher's tests that
binds its KV-event sockets as ``vllm serve`` does at start-up (vllm/distributed/kv_events.py:
``ZmqEventPublisher.__init__`` → ``_socket_setup`` binds the ``--kv-events-config`` endpoint and
its replay endpoint, and a ZMQError kills the worker), then serves as
:mod:`tests.planner.standin_worker`. It stands in for the engine, not for the launcher."""

from __future__ import annotations

import json
import sys

import zmq

from tests.planner.standin_worker import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--kv-events-config" in argv:
        config = json.loads(argv[argv.index("--kv-events-config") + 1])
        context = zmq.Context.instance()
        publisher = context.socket(zmq.PUB)
        publisher.bind(config["endpoint"])          # raises ZMQError as vLLM's publisher does: the worker dies
        replay = context.socket(zmq.ROUTER)
        replay.bind(config["replay_endpoint"])
    sys.exit(main(argv))
