"""KV events for the router: block stored / removed, per tier, over ZMQ PUB with replay.

Wire format (like vLLM's KV events): each PUB message is three frames
``[topic b"kv", seq (u64 big-endian), payload]``, the payload a msgpack list
``[timestamp, [event, …]]`` and each event a map
``{"type": "stored" | "removed", "tier": str, "owner": str, "namespace": str,
"keys": [bytes, …], "nbytes": int}`` -- ``keys`` are the clients' 32-byte keys.
``seq`` grows by one per message, so a subscriber sees gaps.

Replay: a subscriber that missed messages sends ``seq`` (u64 big-endian) to the
ROUTER socket at ``replay_endpoint`` and receives every buffered message with a
sequence number ≥ ``seq`` as ``[seq, payload]`` frames, then ``[b"", b""]``.
The last ``buffer`` messages are kept.

Events come from any thread (tier eviction hooks run in I/O threads); one
publisher thread owns the sockets (ZMQ sockets are not thread safe) and batches
what arrived in the last few milliseconds into one message.
"""

from __future__ import annotations

import collections
import queue
import struct
import threading
import time

TOPIC = b"kv"
_SEQ = struct.Struct(">Q")


class EventPublisher:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *, buffer: int = 10000,
                 batch_s: float = 0.005) -> None:
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.bind(endpoint)
        self.endpoint = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._replay = None
        self.replay_endpoint = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._ring: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer)
        self._batch_s = batch_s
        self.seq = 0
        self.emitted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-events", daemon=True)
        self._thread.start()

    def emit(self, kind: str, tier: str, owner: str, namespace: str, keys: list[bytes], nbytes: int) -> None:
        """Queue one event (any thread, never blocks)."""
        self._queue.put({"type": kind, "tier": tier, "owner": owner, "namespace": namespace,
                         "keys": keys, "nbytes": nbytes})

    def _run(self) -> None:
        import msgpack

        zmq = self._zmq
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while not self._stop.is_set():
            batch = []
            try:
                batch.append(self._queue.get(timeout=self._batch_s))
                while len(batch) < 1000:
                    batch.append(self._queue.get_nowait())
            except queue.Empty:
                pass
            if batch:
                payload = msgpack.packb([time.time(), batch], use_bin_type=True)
                seq = self.seq
                self.seq += 1
                self.emitted += len(batch)
                self._ring.append((seq, payload))
                self._pub.send_multipart([TOPIC, _SEQ.pack(seq), payload])
            if self._replay is not None and poller.poll(0):
                self._serve_replay()

    def _serve_replay(self) -> None:
        zmq = self._zmq
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            ident, body = frames[0], frames[-1]
            if len(body) != _SEQ.size:
                self._replay.send_multipart([ident, b"", b""])
                continue
            (start,) = _SEQ.unpack(body)
            for seq, payload in list(self._ring):
                if seq >= start:
                    self._replay.send_multipart([ident, _SEQ.pack(seq), payload])
            self._replay.send_multipart([ident, b"", b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._pub.close()
        if self._replay is not None:
            self._replay.close()
        self._ctx.term()


def replay(endpoint: str, since: int, timeout_s: float = 2.0) -> list[tuple[int, list]]:
    """Client side of replay: (seq, events) of every buffered message with seq ≥ ``since``."""
    import msgpack
    import zmq

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", _SEQ.pack(since)])
        out = []
        while True:
            frames = sock.recv_multipart()
            seq_raw, payload = frames[-2], frames[-1]
            if not seq_raw:
                return out
            out.append((_SEQ.unpack(seq_raw)[0], msgpack.unpackb(payload, raw=False)[1]))
    finally:
        sock.close()
