"""The scheduler half of the connector: how many prompt tokens kvtier holds, and what to move.

* **Lookup.** A request's kvtier keys are chained over vLLM's own block hashes
  (which already carry ``cache_salt``, the LoRA adapter's name and path, and multimodal
  hashes), one per kvtier block; a LoRA request's are rooted in its adapter's files and the
  engine's LoRA settings too, named once per request and handed to the workers with its
  loads and saves (:mod:`~kvtier.integrations.vllm.lora_digest`; an adapter whose files
  cannot be read, or are not those vLLM loaded under the request's ``lora_int_id``: neither
  looked up nor saved; nor, from then on, a request whose adapter's files change while it
  runs, though not for a change of their identity alone, such as a ``chmod``; files written with
  the same bytes, such as a ``touch``, stop its saves alone). The hit is
  the store's longest prefix, cut to whole vLLM pages and so that at least two tokens remain
  to compute (see ``MIN_COMPUTED_TOKENS``).
* **Loads** cover the pages past vLLM's local prefix hit; a load may stop
  inside a kvtier block (the worker reads the block and writes only the pages
  asked for). Loads are asynchronous (other requests keep running) unless the
  request is alone in the engine, or the load is small and every block it reads
  sits in a tier whose reads are bounded (``Tier.bounded_reads``: the host tier,
  a kvtier server, Mooncake Store; ``sync_load_max_bytes``): then it loads in the
  step of its forward, which saves the request an engine step of waiting.
* **Saves** cover each kvtier block once all its tokens are computed, unless the
  lookup found it in the store already. A LoRA request that vLLM served pages of its prefix
  cache that another version of its adapter may have computed (files replaced in place, or a
  request of the adapter that could not be named computed there; that cache not reset since:
  ``AdapterKeys.note_in_prefix_cache``) saves nothing.
* **Sliding windows.** Where vLLM dropped a request's leading pages out of the window
  (``NULL_PAGE``), nothing is loaded into them and nothing is saved from them. vLLM frees a
  running request's pages as its window moves and never says so (the null page takes their
  place in its own table only): a save is planned only from pages within the window of the
  tokens computed before the step (``window_tokens``), so a save rewound after a failed load
  is never planned again from pages vLLM has given another request.
* **P/D.** A prefill instance returns ``{"kvtier_blocks": n}`` as the request's
  ``kv_transfer_params``: blocks 0..n-1 are in the store or queued (a block skipped as out of a
  sliding window ends that prefix); a decode instance given them waits (up to ``pd_wait_s``) until
  the store shows those blocks, since the prefill instance's writes are asynchronous. A request
  that finishes while a step with a synchronous load and saves of its own awaits its report
  announces none of the blocks from those saves on: a failed load drops them (vLLM takes the
  step's report after it frees the request), and the decode instance would wait for blocks never
  stored. A LoRA request whose adapter's files changed announces none: the workers drop the saves
  of a step run after the change, and a decode instance that names the new files looks up other
  keys, so it would wait for blocks it can never see (one that names the old files still loads
  whatever is stored, without waiting). Files written with the same bytes (a ``touch``, a
  redeploy) drop the saves of the steps the workers checked after the write too, and may have held
  another version in between: the request announces none of the blocks of the saves not known to
  be checked before, and saves nothing more; nor does a request whose saves a worker reports
  dropped (``update``'s ``adapter_dropped``), from its first dropped block on. (A request that
  finishes in the step of the drop has announced its blocks already: vLLM takes the step's report
  after it frees the request.)
* **Steps in flight.** With more than one batch in flight (async scheduling, pipeline
  parallelism) vLLM builds step N+1 before it takes step N's report. Each build is kept
  (its synchronous loads, its saves) until its report: a report charges a failed load
  only to the loads of its own step, and a failure rewinds the save cursors of every save
  the workers dropped for it (that step's and those built before the report, see
  ``KvtierMetadata.reported_step``), so those blocks are planned again.
* **Reset** (``reset``, vLLM's ``reset_cache``): a fresh random key epoch; every later lookup,
  load and save keys under it, so nothing stored before hits again (the store keeps it
  until evicted). Requests known at the reset save nothing more (their pages may hold KV of
  the old weights) unless they come back with nothing computed.
* **KV events** (``host_events``, with vLLM's KV events on and a host tier): each save planned
  is described, and the workers' reports of what their host tiers hold become ``BlockStored``
  / ``BlockRemoved`` events of medium ``"CPU"`` (:mod:`~kvtier.integrations.vllm.host_events`);
  a reset removes them all.

Not thread safe: vLLM calls the scheduler connector from its scheduler thread only.
A lookup that fails (a tier down, a timeout) counts as a miss; it never raises.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from kvtier.integrations.vllm.config import ConnectorConfig, EngineKV
from kvtier.integrations.vllm.host_events import HostEvents, HostReport
from kvtier.integrations.vllm.lora_digest import AdapterFiles, AdapterKeys, unwritten_between
from kvtier.core.keys import BlockKey
from kvtier.store.tiered import PrefixMatch
from kvtier.integrations.vllm.metadata import BlockTransfer, KvtierMetadata, LoadJob, SaveJob

log = logging.getLogger(__name__)

PD_PARAM = "kvtier_blocks"
#: vLLM's placeholder page (``BlockPool.null_block``, always block id 0). A sliding-window or
#: local-attention KV cache puts it where a request's leading pages fell out of the window,
#: for a local prefix hit as for external tokens. Its KV is zeros that vLLM relies on and
#: that belong to no block: never load into it, and never save it as a block's KV (that
#: stored zeros under a real block's key, served later to a request whose window needs them).
NULL_PAGE = 0
#: tokens a hit leaves to compute: results then match a cold run bit for bit
MIN_COMPUTED_TOKENS = 2


class Match(NamedTuple):
    """Result of a lookup: ``external_tokens`` past vLLM's ``local_tokens``."""

    local_tokens: int
    external_tokens: int
    stored_blocks: int


@dataclass(slots=True)
class _Request:
    request: object  #: vllm.v1.request.Request (kept for its growing block_hashes)
    #: its LoRA adapter as its keys name it ("": none); None: the adapter's files cannot be read,
    #: or changed while it ran, so kvtier neither looks the request up nor saves it
    adapter: str | None = ""
    #: the files ``adapter`` was named from, as they were then (None: none to check)
    adapter_files: AdapterFiles | None = None
    #: the first step it may have computed in (built after its first lookup)
    since_step: int = 0
    #: (step, first block) of its save jobs carrying ``adapter_files`` whose worker may check them
    #: after they change: no report of their step taken when those files were last seen unchanged
    unchecked_saves: list[tuple[int, int]] = field(default_factory=list)
    #: never saved (again): vLLM served it pages of its prefix cache that another version of its
    #: adapter may have computed (``AdapterKeys.note_in_prefix_cache``), or its adapter's files were
    #: written while it ran (another version may have come and gone; the pages computed then, and
    #: every later block attending to them, may be that version's)
    no_saves: bool = False
    stored_blocks: int = 0  #: blocks 0..n-1 are in the store, queued for saving, or never to be saved here
    #: blocks 0..n-1 are in the store or queued for saving: what a decode instance is told to
    #: wait for. Below ``stored_blocks`` where a block was skipped (its pages out of a sliding
    #: window): the store will never show the blocks after that gap as a prefix.
    announced_blocks: int = 0
    page_ids: list[int] = field(default_factory=list)
    match: Match | None = None
    load_planned: bool = False
    loading: bool = False  #: an asynchronous load into this request's pages is in flight
    #: page → kvtier block index of the load whose outcome is not reported yet (a failure's
    #: first block); cleared once reported: vLLM may give the pages to another request after
    load_pages: dict[int, int] = field(default_factory=dict)
    load_failed: bool = False  #: a load failed: vLLM recomputes, never load this request again
    async_load: bool = True  #: how the load planned at the last lookup runs
    loaded_tokens: int = 0
    wait_until: float | None = None
    #: known at a ``reset``: its pages may hold KV computed before it, never saved under the new
    #: epoch; cleared when it comes back with nothing computed (preempted, vLLM's cache reset)
    stale: bool = False


@dataclass(slots=True)
class _Step:
    """A built step whose report has not come: what its report concerns."""

    seq: int
    #: its synchronous loads: the request and the ``load_pages`` the load set
    sync_loads: list[tuple[_Request, dict[int, int]]]
    #: its saves: the request and the first block of each; a worker may drop them (a failed load)
    saves: list[tuple[_Request, int]] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerStats:
    lookups: int = 0
    lookup_errors: int = 0
    hit_tokens: int = 0
    load_jobs: int = 0
    save_blocks: int = 0
    pd_waits: int = 0


class SchedulerSide:
    def __init__(
        self,
        config: ConnectorConfig,
        engine: EngineKV,
        lookup: Callable[[list[BlockKey]], PrefixMatch | int],
        *,
        loads: bool,
        saves: bool,
        bounded_tiers: frozenset[str] = frozenset(),
        host_events: HostEvents | None = None,
        adapters: AdapterKeys | None = None,
        window_tokens: int | None = None,
    ) -> None:
        """``lookup(keys)`` returns the store's longest prefix of ``keys`` (the worker's store):
        a :class:`PrefixMatch` where this process holds the store and can tell which tier
        holds each block, else just its length (a lookup socket). ``bounded_tiers``: the
        names of the store's tiers with bounded reads (``Tier.bounded_reads``); a small
        load from those alone runs in its forward's step (``sync_load_max_bytes``).
        ``host_events``: the CPU-medium KV events' queue, None when none are published.
        ``adapters``: names a LoRA request's adapter in its keys (default: an engine without
        LoRA settings). ``window_tokens``: the KV cache's sliding window (vLLM frees the pages
        behind it); None: taken from the engine's page format, the narrowest window the
        connector accepts (``block_tokens``) for a sliding-window cache, else none."""
        self.config = config
        self.host_events = host_events
        self.adapters = adapters if adapters is not None else AdapterKeys(None)
        self.engine = engine
        self.lookup = lookup
        self.bounded_tiers = bounded_tiers
        self.window_tokens = window_tokens if window_tokens is not None else _window_of(engine)
        self.loads = loads
        self.saves = saves
        self.stats = SchedulerStats()
        self._requests: dict[str, _Request] = {}
        self._pending_loads: list[LoadJob] = []
        #: synchronous loads planned for the next build: a load's outcome comes with the report
        #: of the step that ran it (invalid pages), then its pages are no longer its own
        self._sync_loads: list[tuple[_Request, dict[int, int]]] = []
        #: built steps not reported yet, oldest first (vLLM reports steps in order)
        self._steps: deque[_Step] = deque()
        self._next_step = 0
        self._reported_step = -1
        #: the live LoRA requests of each adapter name and path (vLLM's prefix cache keys their pages
        #: by those): checked at every lookup of the adapter, before its pages are reused
        self._of_adapter: dict[tuple[str, str], dict[str, _Request]] = {}
        #: finished LoRA requests with saves whose report has not come: request → (its
        #: ``lora_request``, the last such step); a drop it reports still marks their pages
        self._finished_unreported: dict[str, tuple[object, int]] = {}
        #: the key epoch: "" until the first reset (keys as before epochs existed)
        self.epoch = ""

    # -- lookup ---------------------------------------------------------------------
    def num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._state(request)
        if state.stale and num_computed_tokens == 0:
            # back after a reset with nothing computed: its pages will hold KV of the current
            # weights only; what it stored before is under the old epoch
            state.stale = False
            state.stored_blocks = state.announced_blocks = 0
        self._check_adapter(state, num_computed_tokens)
        # vLLM reads no cached block for a request that skips the prefix cache (prompt logprobs:
        # a block keeps no logits) and drops whatever is returned here: no lookup, no P/D wait
        # nor for one whose adapter's files could not be read (its KV has no identity to key it by)
        if not self.loads or state.load_failed or state.adapter is None \
                or getattr(request, "skip_reading_prefix_cache", False):
            return 0, False
        state.load_planned = False  # a fresh admission (a new request, or one preempted) plans afresh
        state.load_pages = {}       # (a preempted request's pages went back to vLLM)
        hashes = self.engine.block_hashes(request.block_hashes, request.num_tokens)
        stored, tiers = self._lookup(hashes, state.adapter)
        announced = min(_announced_blocks(request), len(hashes))
        if stored < announced:
            now = time.monotonic()
            if state.wait_until is None:
                state.wait_until = now + self.config.pd_wait_s
                self.stats.pd_waits += 1
            if now < state.wait_until:
                return None, False  # the prefill instance's writes are still landing
        page = self.engine.page_tokens
        # Leave at least two tokens to compute. vLLM must compute one; and a
        # one-token forward takes the matrix-vector path, whose rounding differs
        # from the prefill GEMM's: the loaded run would then differ from a cold
        # one in the last bits (measured on the CPU backend), which a cache must not do.
        cap = max(0, request.num_tokens - MIN_COMPUTED_TOKENS) // page * page
        usable = min(stored * self.engine.block_tokens, cap)
        external = max(0, usable - num_computed_tokens)
        state.match = Match(num_computed_tokens, external, stored)
        state.stored_blocks = max(state.stored_blocks, stored)
        state.announced_blocks = max(state.announced_blocks, stored)
        state.async_load = self.config.async_load and not (
            (self.config.sync_load_when_alone and self._alone(request))
            or self._bounded_read(tiers, num_computed_tokens, usable))
        return external, external > 0 and state.async_load

    def _check_adapter(self, state: _Request, local_tokens: int) -> None:
        """At a LoRA request's lookup (it computes next, into vLLM's prefix cache under its adapter's
        name and path): its adapter's files are still those it was named from, and the
        ``local_tokens`` vLLM's prefix cache gives it were computed under them. A request whose
        adapter has no name computes there all the same, with a version not known here."""
        lora = getattr(state.request, "lora_request", None)
        if lora is None:
            return
        self._check_others_of_adapter(lora, state)
        if state.adapter_files is None:   # not named, or its adapter replaced while it ran
            self.adapters.computed_unnamed(lora)
        elif self._adapter_unchanged(state) and not self.adapters.note_in_prefix_cache(lora, state.adapter) \
                and local_tokens:
            state.no_saves = True

    def _check_others_of_adapter(self, lora, state: _Request) -> None:
        """Check the files of every other live request of ``lora``'s name and path (a few ``stat``
        calls per version named, some 0.15 µs per live request). One whose files were written since
        it was last checked (with ``load_inplace``, another version written and rolled back
        meanwhile) may have computed pages with another version, which vLLM's prefix cache may give
        this request now: its check marks them (:meth:`_stop_saves_after_write`) before this
        request's pages are noted. Otherwise it is checked only when it completes a block, or
        finishes: another request vLLM served those pages to in between saved them under this
        version's keys."""
        live = self._of_adapter.get((lora.lora_name, lora.lora_path), {})
        # by id: the requests named from one version share its files (one check each)
        named_from = {id(other.adapter_files): other.adapter_files for other in live.values()}
        changed = {key for key, files in named_from.items() if files is not None and not files.unchanged()}
        if not changed:
            return
        for other in [other for other in live.values() if id(other.adapter_files) in changed]:
            if other is not state:
                self._adapter_unchanged(other)

    def _adapter_unchanged(self, state: _Request) -> bool:
        """Whether a LoRA request's adapter files are those its keys name. vLLM reads them again while
        a request runs (after an unload, at every step with ``load_inplace``): changed, its later KV
        is another version's, and it is neither looked up nor saved again, nor announces any block
        to a decode instance (see the module's P/D). Files whose identity alone changed (a
        ``chmod``, a ``touch``, the same bytes written again) are named again: the same version,
        whose new identity is kept; written (not a ``chmod``), the request saves nothing more."""
        files = state.adapter_files
        if files is None:
            return True
        if files.unchanged():
            self._forget_checked_saves(state)
            return True
        renamed = self.adapters.for_request(state.request.lora_request)   # hashed once per new identity
        if renamed.key != state.adapter:
            self.adapters.replaced_while_running(state.request.lora_request, renamed.key)
            state.adapter = state.adapter_files = None
            state.announced_blocks = 0
            return False
        if not unwritten_between(files, renamed.files):
            self._stop_saves_after_write(state)
        state.adapter_files = renamed.files
        return True

    def _forget_checked_saves(self, state: _Request) -> None:
        """The request's adapter files are still those it was named from: the saves of every step
        reported by now were checked by the workers before, against those files, and kept."""
        state.unchecked_saves = [(step, first) for step, first in state.unchecked_saves
                                 if step > self._reported_step]

    def _stop_saves_after_write(self, state: _Request) -> None:
        """The request's adapter files were written since they were last seen, though they hold
        the same version now (a ``touch``, the same bytes deployed again, or another version
        written and rolled back: with ``load_inplace`` vLLM may have computed steps with it). A
        worker that checked them after the write dropped the job's saves
        (``WorkerAdapterCheck.held``) and reports so (``update``'s ``adapter_dropped``), but only
        with a later step's report, after vLLM may have freed the request: the saves not known to be
        checked before are not announced to a decode instance. Nor is anything saved again: planned
        again from the same pages, the dropped blocks stored the other version's KV under this
        one's keys, and so did every later block, computed over it. The pages it computed sit in
        vLLM's prefix cache under the adapter's name and path all the same: noted as computed with
        the version vLLM holds (with ``load_inplace``, one not known: the name and path then hold
        several), so another request served from them is not saved under this version's keys."""
        self._stop_saves(state, _first_unchecked_save(state))

    def _stop_saves(self, state: _Request, first_unsaved: int) -> None:
        """The LoRA request's blocks ``first_unsaved``.. may hold another version's KV, or sit over
        it: none is announced, nothing of it is saved again, and the pages it computed are noted in
        vLLM's prefix cache as computed with the version vLLM holds under its id (with
        ``load_inplace``, one not known)."""
        self.adapters.computed_unnamed(state.request.lora_request)
        state.announced_blocks = min(state.announced_blocks, first_unsaved)
        state.unchecked_saves = []
        state.no_saves = True

    def _bounded_read(self, tiers: list[str] | None, local_tokens: int, usable_tokens: int) -> bool:
        """The load of tokens ``local_tokens..usable_tokens`` is at most ``sync_load_max_bytes``
        and every block it reads sits in a tier whose reads are bounded: a memcpy or one call
        with its deadline, cheaper than the engine step an asynchronous load waits (the
        request joins the batch only in the step after its load ends)."""
        limit = self.config.sync_load_max_bytes
        if tiers is None or usable_tokens <= local_tokens or \
                (usable_tokens - local_tokens) * self.engine.layout.bytes_per_token > limit:
            return False
        first, end = local_tokens // self.engine.block_tokens, -(-usable_tokens // self.engine.block_tokens)
        return end <= len(tiers) and all(tier in self.bounded_tiers for tier in tiers[first:end])

    def _alone(self, request) -> bool:
        """No other request is in the engine (waiting, loading or running): every request
        the scheduler admits passes through this side's lookup and leaves through ``finished``."""
        return len(self._requests) == 1 and request.request_id in self._requests

    def _lookup(self, hashes: list[bytes], adapter: str) -> tuple[int, list[str] | None]:
        """Blocks the store holds as a prefix, and the tier of each (None: not known here)."""
        if not hashes:
            return 0, None
        self.stats.lookups += 1
        try:
            found = self.lookup(self.engine.keys(hashes, self.epoch, adapter))
        except Exception as exc:  # noqa: BLE001 - a broken tier is a miss, never a failed request
            self.stats.lookup_errors += 1
            log.warning("kvtier lookup failed (%s); treating it as a miss", exc)
            return 0, None
        if isinstance(found, PrefixMatch):
            return found.hit_blocks, found.tiers
        return found, None

    # -- allocation -------------------------------------------------------------------
    def after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        state = self._state(request)
        state.page_ids = list(block_ids)
        if num_external_tokens <= 0 or state.load_planned or state.match is None:
            return
        k = self.engine.pages_per_block
        page = self.engine.page_tokens
        first_page = state.match.local_tokens // page
        end_page = first_page + num_external_tokens // page
        # Out-of-window pages (sliding window) lead the range as the null page: nothing to load.
        while first_page < end_page and state.page_ids[first_page] == NULL_PAGE:
            first_page += 1
        transfers = []
        for index in range(first_page // k, (end_page - 1) // k + 1) if first_page < end_page else ():
            lo, hi = max(first_page, index * k), min(end_page, (index + 1) * k)
            transfers.append(BlockTransfer(index, lo - index * k, state.page_ids[lo:hi]))
        # A job even when every page is out of the window: an asynchronous load must still end.
        hashes = (self.engine.block_hashes(request.block_hashes, request.num_tokens)[: transfers[-1].index + 1]
                  if transfers else [])
        self._pending_loads.append(
            LoadJob(request.request_id, hashes, transfers, is_async=state.async_load, adapter=state.adapter)
        )
        state.load_planned = True
        state.load_pages = {p: t.index for t in transfers for p in t.page_ids}
        state.loading = state.async_load
        if not state.async_load:
            self._sync_loads.append((state, state.load_pages))
        state.loaded_tokens = num_external_tokens
        self.stats.load_jobs += 1
        self.stats.hit_tokens += num_external_tokens

    # -- per step ------------------------------------------------------------------------
    def build(self, scheduler_output) -> KvtierMetadata:
        meta = KvtierMetadata(loads=self._pending_loads, idle_step=scheduler_output.total_num_scheduled_tokens == 0,
                              step=self._next_step, reported_step=self._reported_step, epoch=self.epoch)
        step = _Step(self._next_step, self._sync_loads)
        self._steps.append(step)
        self._next_step += 1
        self._pending_loads = []
        self._sync_loads = []
        if not self.saves:
            return meta
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.page_ids = list(new.block_ids[0])
            self._plan_save(meta, new.req_id, state, new.num_computed_tokens, scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.page_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                state.page_ids.extend(new_ids[0])
            self._plan_save(meta, req_id, state, cached.num_computed_tokens[i], scheduled.get(req_id, 0))
        step.saves = [(self._requests[job.req_id], job.blocks[0].index) for job in meta.saves]
        return meta

    def _plan_save(self, meta: KvtierMetadata, req_id: str, state: _Request, num_computed: int,
                   num_scheduled: int) -> None:
        """Queue the blocks whose last token this step computes (KV of known tokens only): the
        request had ``num_computed`` tokens computed before the step, which computes
        ``num_scheduled`` more."""
        engine = self.engine
        computed_tokens = num_computed + num_scheduled
        if state.stale or state.adapter is None or state.no_saves:
            return
        # Most steps of a request save nothing (a decode step completes a block every
        # block_tokens tokens): say so before listing its blocks' hashes, which costs Python per
        # block of every running request every step (3.3 ms a step at 256 requests of 32 k).
        if min(len(state.request.block_hashes) * engine.hash_tokens, computed_tokens) // engine.block_tokens \
                <= state.stored_blocks:
            return
        hashes = engine.block_hashes(state.request.block_hashes, computed_tokens)
        k = engine.pages_per_block
        full = min(len(hashes), len(state.page_ids) // k)
        # (the check of its adapter's files may stop its saves: written since last seen)
        if full <= state.stored_blocks or not self._adapter_unchanged(state) or state.no_saves:
            return
        held = self._first_page_held(num_computed)
        transfers = [
            BlockTransfer(index, 0, pages)
            for index in range(state.stored_blocks, full)
            if index * k >= held and NULL_PAGE not in (pages := state.page_ids[index * k : (index + 1) * k])
        ]
        for transfer in transfers:   # the prefix grows only through blocks queued here, without a gap
            if transfer.index == state.announced_blocks:
                state.announced_blocks += 1
        state.stored_blocks = full
        if not transfers:
            return
        meta.saves.append(SaveJob(req_id, hashes[:full], transfers, state.adapter, state.adapter_files,
                                  state.since_step))
        if state.adapter_files is not None:
            state.unchecked_saves.append((meta.step, transfers[0].index))
        self.stats.save_blocks += len(transfers)
        if self.host_events is not None:
            self.host_events.planned(state.request, [(t.index, hashes[t.index]) for t in transfers])

    def _first_page_held(self, num_computed: int) -> int:
        """The request's first page vLLM surely still holds for it, ``num_computed`` tokens computed:
        a sliding window's manager frees (hands to other requests) the pages of tokens more than
        the window behind the processed ones (``SlidingWindowManager.get_num_skipped_tokens``, on
        no more tokens than ``num_computed``), and puts the null page in its own block table only.
        A block saved in the step that computes its last token lies past them (a block is no
        longer than the window); one rewound after a failed load (:meth:`update`) may not."""
        if self.window_tokens is None:
            return 0
        return max(0, num_computed - self.window_tokens + 1) // self.engine.page_tokens

    def update(self, finished_loads, invalid_pages, step: int | None = None,
               adapter_dropped: dict[str, int] | None = None) -> None:
        """Take the workers' report of a step: loads that ended, pages they could not fill, LoRA
        saves they dropped.

        ``step``: the step the report is of (the workers' ``KvtierWorkerMetadata``); None: the
        oldest step not reported yet (vLLM reports steps in order, but skips an empty report:
        the connector passes the step).

        A failed load's blocks from its first failed one on are neither stored nor announced:
        vLLM recomputes them, and they are saved as they are computed again (before, the save
        cursor had passed them at the lookup, so they were never saved, and a decode instance
        was told to wait for them). Only loads whose outcome is pending are matched: a
        synchronous load of this step (or an earlier one), an asynchronous load in flight; not a
        load reported before, one of a later step (built before this report came), nor one
        planned for pages vLLM has since given another request.

        A worker whose load failed drops the saves of that step and of every step built before
        the scheduler took the failure's report (``KvtierMetadata.reported_step``): the save
        cursors of all of those rewind, and their blocks are planned again (their pages still
        hold them, or vLLM recomputes them; a block whose pages a sliding window has freed since
        is not saved here: :meth:`_first_page_held`).

        ``adapter_dropped``: request → the first block of the LoRA saves a worker dropped
        (``KvtierWorkerMetadata.adapter_dropped``): the adapter's files may not have held the
        version named while vLLM computed them. Files whose stamps came back as they were (a link
        flipped away and back, files unreadable for a moment) cannot tell the scheduler so:
        the request announces none of them, saves nothing more, and the pages it computed are
        noted as of a version not known (:meth:`_stop_saves`); so are a finished request's."""
        if step is None:
            step = self._steps[0].seq if self._steps else self._reported_step
        reported = []
        while self._steps and self._steps[0].seq <= step:
            reported.append(self._steps.popleft())
        self._reported_step = max(self._reported_step, step)
        if invalid_pages:
            pending = [(state, pages) for s in reported for state, pages in s.sync_loads]
            pending += [(state, state.load_pages) for state in self._requests.values() if state.loading]
            for state, pages in pending:
                failed = [index for page, index in pages.items() if page in invalid_pages]
                if failed and state.load_pages is pages:
                    state.load_failed = True
                    _rewind(state, min(failed))
            for dropped in (*reported, *self._steps):
                for state, first in dropped.saves:
                    _rewind(state, first)
        for req_id in finished_loads or ():
            state = self._requests.get(req_id)
            if state is not None:
                state.loading = False
                state.load_pages = {}
        for s in reported:
            for state, pages in s.sync_loads:
                if state.load_pages is pages:
                    state.load_pages = {}
        self._take_adapter_drops(adapter_dropped or {})

    def _take_adapter_drops(self, dropped: dict[str, int]) -> None:
        """The workers dropped these LoRA saves (see :meth:`update`); then forget the finished
        requests whose every save is reported."""
        for req_id, first in dropped.items():
            state = self._requests.get(req_id)
            if state is not None:
                self._stop_saves(state, first)
                self._stop_saves_of_adapter(state.request.lora_request)
            elif req_id in self._finished_unreported:   # finished: its pages stay in vLLM's prefix cache
                self.adapters.computed_unnamed(self._finished_unreported[req_id][0])
                self._stop_saves_of_adapter(self._finished_unreported[req_id][0])
        self._finished_unreported = {req_id: finished for req_id, finished in self._finished_unreported.items()
                                     if finished[1] > self._reported_step}

    def _stop_saves_of_adapter(self, lora) -> None:
        """A save of ``lora``'s name and path was dropped: the pages computed then sit in vLLM's
        prefix cache under that name and path, and every live request of it may have been served
        them (looked up before the report came, when they were noted as this version's) or compute
        over them: none saves again, nor announces its saves not known to be checked (a miss,
        never another version's KV)."""
        for other in list(self._of_adapter.get((lora.lora_name, lora.lora_path), {}).values()):
            self._stop_saves(other, _first_unchecked_save(other))

    def host_report(self, report: HostReport) -> None:
        """Take the workers' report of what their host tiers took and lost (KV events)."""
        if self.host_events is not None and report:
            self.host_events.report(report, self.epoch)

    def reset(self) -> bool:
        """Make every later lookup miss what is stored now (``reset_cache``): a fresh random key
        epoch, which the workers take from the next step's metadata. Steps built before key
        their loads and saves as before. Requests known now save nothing more unless they come
        back with nothing computed. Returns True."""
        self.epoch = secrets.token_hex(16)
        for state in self._requests.values():
            state.stale = True
        if self.host_events is not None:
            self.host_events.reset()   # the host tiers' blocks are unreachable now: removed
        log.info("kvtier: connector cache reset; new key epoch %s (blocks stored before stay in the store, "
                 "unseen, until evicted)", self.epoch)
        return True

    def finished(self, request) -> tuple[bool, dict | None]:
        """Forget the request. Returns (keep its pages until the worker reports its
        load done, the ``kv_transfer_params`` a decode instance can wait on)."""
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return False, None
        self._forget_live(state)
        self._adapter_unchanged(state)   # changed since its last save: so are its last pages in vLLM's cache
        loaded = 0 if state.load_failed else state.loaded_tokens
        return state.loading, {PD_PARAM: state.announced_blocks, "kvtier_loaded_tokens": loaded}

    def _state(self, request) -> _Request:
        state = self._requests.get(request.request_id)
        if state is None:
            # the adapter is named once, with the files' identities: checked before each save
            lora = getattr(request, "lora_request", None)
            named = self.adapters.for_request(lora)
            state = self._requests[request.request_id] = _Request(request, named.key, named.files,
                                                                  since_step=self._next_step)
            if lora is not None:
                self._of_adapter.setdefault((lora.lora_name, lora.lora_path), {})[request.request_id] = state
        else:
            state.request = request
        return state


    def _forget_live(self, state: _Request) -> None:
        """A request leaves: no more a live request of its adapter; its saves not reported yet may
        still be reported dropped (:meth:`_take_adapter_drops`)."""
        lora = getattr(state.request, "lora_request", None)
        if lora is None:
            return
        pair = (lora.lora_name, lora.lora_path)
        live = self._of_adapter.get(pair, {})
        live.pop(state.request.request_id, None)
        if not live:
            self._of_adapter.pop(pair, None)
        last_save = max((step for step, _ in state.unchecked_saves), default=-1)
        if last_save > self._reported_step:
            self._finished_unreported[state.request.request_id] = (lora, last_save)


def _first_unchecked_save(state: _Request) -> int:
    """The request's first block of its saves the workers may not have checked yet (all stored
    blocks where none is pending)."""
    return min((first for _, first in state.unchecked_saves), default=state.stored_blocks)


def _window_of(engine: EngineKV) -> int | None:
    """The narrowest sliding window the connector accepts (``check_kv_cache_kind``: a block no
    longer than it) where the engine's page format names a sliding-window cache; else None."""
    try:
        spec = json.loads(engine.format_tag.partition(" ")[2]).get("spec")
    except (ValueError, AttributeError):   # not a vLLM page format (tests name their own)
        return None
    return engine.block_tokens if spec == "SlidingWindowSpec" else None


def _rewind(state: _Request, first: int) -> None:
    """Blocks ``first``.. of the request are neither stored nor queued: plan them again."""
    state.stored_blocks = min(state.stored_blocks, first)
    state.announced_blocks = min(state.announced_blocks, first)


def _announced_blocks(request) -> int:
    """The blocks a prefill instance announced (``kv_transfer_params`` come from the API client):
    a whole number, else none. ``int()`` of JSON's ``1e400`` (infinity) raised OverflowError in
    vLLM's scheduler, which took the engine down for every request."""
    params = getattr(request, "kv_transfer_params", None)
    value = params.get(PD_PARAM, 0) if isinstance(params, dict) else 0
    return max(0, value) if type(value) is int else 0
