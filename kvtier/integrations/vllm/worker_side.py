"""The worker half of the connector: move blocks between the store and vLLM's pages.

* **Loads** write the pages the scheduler asked for from whole kvtier blocks:
  straight from the host pool's pinned slots when the fastest tier is a plain
  host tier (one copy, no staging), else read by the store into a staging
  buffer (verified; blocks from a lower tier are promoted in the background,
  after the load). An asynchronous load runs on a loader thread
  and is reported through ``get_finished`` (vLLM keeps the request waiting and
  its pages reserved until then); a synchronous one finishes in
  ``start_load_kv``, before the forward pass that needs it. Pages a load could
  not fill (a miss, a failed check, a tier down) are reported as load errors,
  so that vLLM recomputes them: never an exception, never stale data.
* **Saves** copy the pages of newly computed blocks into a staging buffer in
  ``wait_for_save`` (so vLLM may reuse the pages right after) and hand the
  buffer to the store's I/O pool; the engine does not wait for the write.
  After a failed load, no save goes until the scheduler has taken that step's
  report (``KvtierMetadata.reported_step``): the steps vLLM ran meanwhile may have
  computed over the pages the load left unfilled. With tensor or pipeline parallelism
  the workers agree on that step (:class:`FailedStepAgreement`): one worker's unfilled
  pages spoil the forward of the ranks beside it and of the stages after it.
* **Keys** are those of the step's ``epoch`` (a ``reset_cache`` starts a new one) and of the
  job's LoRA adapter (named by the scheduler: :mod:`~kvtier.integrations.vllm.lora_digest`).
  A LoRA request's save goes only if its adapter's files held the version the scheduler named
  while the step ran (:class:`~kvtier.integrations.vllm.lora_digest.WorkerAdapterCheck`): vLLM
  loads a step's adapters before its forward, and may have read new files (after an unload, or
  with ``load_inplace``). The very files the scheduler named (``SaveJob.adapter_files``), whose
  ctime alone moved (a ``chmod``), hold it; a worker on another node checks its own copy against
  its own baseline. Any other change drops the step's saves of the adapter, the same bytes written
  again too (another version may have come and gone within the step: its digest would be the
  named one's), and those of every step built before the scheduler took that step's report. The
  report names each request's first dropped block (``KvtierWorkerMetadata.adapter_dropped``,
  :meth:`WorkerSide.report`): the scheduler announces none of them and saves nothing more of it.
* **Host residency** (with KV events on and a host tier): which saved blocks the host tier
  holds or has lost, for the step's report (:mod:`~kvtier.integrations.vllm.host_events`).

Thread safety: the vLLM-facing methods run on the worker's thread; the loader
thread only touches the pages of its own jobs and shares ``_done`` under a lock.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvtier.core.keys import BlockKey
from kvtier.core.payload import BlockMeta
from kvtier.integrations import poison as poisoning
from kvtier.integrations.vllm.config import EngineKV
from kvtier.integrations.vllm.host_events import HostReport, HostResidency
from kvtier.integrations.vllm.lora_digest import WorkerAdapterCheck
from kvtier.integrations.vllm.metadata import BlockTransfer, KvtierMetadata, KvtierWorkerMetadata, LoadJob, SaveJob
from kvtier.integrations.vllm.paged_layout import PagedKV
from kvtier.store.tiered import TieredStore
from kvtier.tiers.base import Status
from kvtier.tiers.host import HostTier

log = logging.getLogger(__name__)


class BlockBuffers:
    """Reused one-block staging buffers. A fresh buffer pays its page faults on first
    touch (~5 ms per 16 MiB here), on the critical path of every load; a reused one
    does not. Keeps at most ``keep_bytes`` idle. Thread safe.

    ``poison`` (debug) hands every buffer out filled with the poison pattern, so a
    store read that reports success without writing cannot pass on stale bytes."""

    def __init__(self, block_nbytes: int, keep_bytes: int = 256 << 20, *, poison: bool = False) -> None:
        self.block_nbytes = block_nbytes
        self.poison = poison
        self._keep = max(1, keep_bytes // block_nbytes)
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, n: int) -> list[np.ndarray]:
        with self._lock:
            got = [self._free.pop() for _ in range(min(n, len(self._free)))]
        got += [np.empty(self.block_nbytes, dtype=np.uint8) for _ in range(n - len(got))]
        if self.poison:
            for buf in got:
                poisoning.fill_bytes(buf)
        return got

    def give(self, buffers: list[np.ndarray]) -> None:
        with self._lock:
            self._free.extend(buffers[: self._keep - len(self._free)])


class _Served(NamedTuple):
    done: int  #: blocks of the run whose pages were written
    more: bool  #: the run was served whole: the load may go on past it


def direct_host_tier(store: TieredStore) -> HostTier | None:
    """The store's fastest tier when loads may copy straight out of it: a plain host pool
    (its ``get`` is a pinned memcpy, which ``borrow_many`` makes zero-copy)."""
    first = store.tiers[0] if store.tiers else None
    return first if type(first) is HostTier else None


@dataclass(slots=True)
class WorkerStats:
    load_jobs: int = 0
    #: of those, loads run between steps: each kept its request out of the batch until the
    #: step after it ended (the others ran in the step of their forward)
    async_load_jobs: int = 0
    load_seconds: float = 0.0  #: wall time of loads: store reads + page writes
    loaded_blocks: int = 0
    failed_pages: int = 0
    saved_blocks: int = 0
    save_failures: int = 0
    #: blocks not saved because a load of their step, or of a step before it that the scheduler
    #: had not taken the report of, failed, on this worker or another of the engine (their KV may
    #: have been computed on pages the load left unfilled)
    saves_dropped: int = 0
    #: blocks not saved because their LoRA adapter's files were written since the scheduler named them
    #: (the step may have computed with another version)
    adapter_saves_dropped: int = 0


class FailedStepAgreement:
    """How the workers of one engine agree on the last step whose loads failed
    (``WorkerSide._failed_step``), in each step whose metadata has a synchronous load.

    Such a load that fails on one worker spoils the step's forward beyond that worker: the
    tensor-parallel ranks of a pipeline stage all-reduce their attention outputs, and each stage
    hands its hidden states to the next. So a stage takes the upstream stage's step (sent point to
    point, on the pipeline's CPU group), then its ranks take the MAX over the stage (all-reduce on
    its tensor-parallel CPU group), then pass it on downstream. No collective spans the pipeline:
    a stage starts its loads (vLLM's ``start_load_kv``) before it sends its hidden states on, while
    the next stage waits for them before it starts the step: such an all-reduce would never
    complete. Nor vLLM's world group: with data parallelism it holds other engines' workers,
    running other steps.

    Every worker of the engine calls :meth:`agree` in the same steps (the metadata is the same on
    every worker), in step order, on the thread that runs vLLM's steps: at the end of
    ``start_load_kv``, which vLLM calls once a step on every worker, a step without a forward too.
    Not in ``wait_for_save``: vLLM's V1 model runner with speculative decoding calls it on the
    last pipeline stage only, which would wait for ever for the earlier stages' step. Stage k's
    failure does not reach stages before k: their KV does not depend on its pages.
    """

    #: the tag of the pipeline messages, apart from vLLM's own on that group (tag 0)
    PIPELINE_TAG = 0x6B7674

    def __init__(self, tp_group, pp_group) -> None:
        """``tp_group``, ``pp_group``: vLLM's ``GroupCoordinator`` of this worker's stage and
        of its pipeline."""
        self._tp = tp_group
        self._pp = pp_group
        #: steps sent downstream, each with the tensor its send reads until it completes
        self._sending: list[tuple] = []

    @classmethod
    def of_vllm(cls) -> "FailedStepAgreement | None":
        """From vLLM's parallel state; None where there is nobody to agree with (one worker, or
        no parallel state initialised)."""
        from vllm.distributed import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            return None
        tp, pp = parallel_state.get_tp_group(), parallel_state.get_pp_group()
        if tp.world_size == 1 and pp.world_size == 1:
            return None
        return cls(tp, pp)

    def agree(self, failed_step: int) -> int:
        """The latest of this worker's ``failed_step``, its stage's and every upstream stage's."""
        import torch
        import torch.distributed as dist

        step = torch.tensor([failed_step], dtype=torch.int64)
        if not self._pp.is_first_rank:
            upstream = torch.empty_like(step)
            dist.recv(upstream, src=self._pp.prev_rank, group=self._pp.cpu_group, tag=self.PIPELINE_TAG)
            step = torch.maximum(step, upstream)
        if self._tp.world_size > 1:
            dist.all_reduce(step, op=dist.ReduceOp.MAX, group=self._tp.cpu_group)
        if not self._pp.is_last_rank:
            # Not waited for: the next stage receives it once it starts its step, after ours.
            self._sending = [(work, sent) for work, sent in self._sending if not work.is_completed()]
            work = dist.isend(step, dst=self._pp.next_rank, group=self._pp.cpu_group, tag=self.PIPELINE_TAG)
            self._sending.append((work, step))
        return int(step.item())


class WorkerSide:
    """``poison`` (debug): before each load, fill its pages and staging buffers with
    NaN (:mod:`kvtier.integrations.poison`); a load that writes nothing then shows."""

    def __init__(self, engine: EngineKV, store: TieredStore, *, poison: bool = False,
                 residency: HostResidency | None = None) -> None:
        """``residency``: follows what the host tier holds of this worker's saves (KV events)."""
        self.engine = engine
        self.store = store
        self.poison = poison
        self.residency = residency
        #: vLLM's CPU split-KV decode turned off for this model's windows (cpu_windows.py)
        self.split_kv_off = False
        self.paged: PagedKV | None = None
        self.stats = WorkerStats()
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-load")
        self._lock = threading.Lock()
        self._inflight: dict[str, Future] = {}
        self._load_errors: set[int] = set()
        self._saves: list[Future] = []
        #: the step being run (its metadata's ``step``), and the last one whose loads failed:
        #: saves are dropped until the scheduler has taken that step's report
        self.step = 0
        self._failed_step = -1
        #: loads copy from this host pool without staging; None: every read goes through
        #: the store (tests set it to None to make store reads fail)
        self.direct_host = direct_host_tier(store)
        #: the other workers of the engine (tensor and pipeline ranks); None: this one alone
        self._agreement = FailedStepAgreement.of_vllm()
        self._adapters = WorkerAdapterCheck()
        #: LoRA saves dropped since the last report: request → its first block dropped
        self._adapter_drops: dict[str, int] = {}
        #: adapter directory → the last step whose saves of it were dropped, until the scheduler
        #: has taken the report carrying the drop (``KvtierMetadata.reported_step``; that step's own
        #: report, or the next one with speculative decoding): a few steps in flight
        self._adapter_drop_steps: dict[str, int] = {}
        #: adapter directories of the LoRA saves dropped since the last report
        self._adapter_drop_dirs: set[str] = set()

    def register(self, kv_caches) -> None:
        self.paged = PagedKV(kv_caches, self.engine)
        self._buffers = BlockBuffers(self.paged.block_nbytes, poison=self.poison)
        log.info("kvtier: %d KV layers of pages %s %s; blocks of %d pages, %d bytes",
                 len(self.paged.layers), self.paged.page_shape, self.paged.dtype,
                 self.paged.pages_per_block, self.paged.block_nbytes)

    # -- loads -----------------------------------------------------------------------
    def start_loads(self, meta: KvtierMetadata) -> None:
        """Run the step's synchronous loads, start its asynchronous ones, then agree with the
        engine's other workers on the last step whose loads failed (vLLM's ``start_load_kv``)."""
        self.step = meta.step
        for job in meta.loads:
            self.stats.load_jobs += 1
            if job.is_async:
                self.stats.async_load_jobs += 1
                self._inflight[job.req_id] = self._loader.submit(self._load, job, meta.epoch)
            else:
                failed = self._load(job, meta.epoch)
                self._load_errors |= failed
                if failed:
                    self._failed_step = self.step
        self._agree_on_failed_step(meta)

    def _agree_on_failed_step(self, meta: KvtierMetadata) -> None:
        """Take the engine's last failed step (:class:`FailedStepAgreement`) in a step with a
        synchronous load, once this worker's are done: another worker's failed one spoils this
        step's forward here too. Only a synchronous load runs in the step of its request's
        forward: an asynchronous one's request runs once every worker reported it done, its failed
        pages with it, so vLLM recomputes them. Other steps skip the agreement's cost (a gloo
        round trip on the step's critical path, before the forward)."""
        if self._agreement is not None and any(not job.is_async for job in meta.loads):
            self._failed_step = self._agreement.agree(self._failed_step)

    def _load(self, job: LoadJob, epoch: str = "") -> set[int]:
        """Fill the job's pages from the blocks of key epoch ``epoch``; returns the ids of pages
        left unfilled."""
        if self.paged is None:
            return {p for t in job.blocks for p in t.page_ids}
        loaded = 0
        start = time.perf_counter()
        if self.poison:
            self.paged.poison(job.blocks)
        try:
            keys = self.engine.keys(job.hashes, epoch, job.adapter)
            wanted = [keys[t.index] for t in job.blocks]
            # Promotions of blocks this load reads from a lower tier wait until the whole
            # load is over: their reads would compete with ours.
            with self.store.reading():
                while loaded < len(wanted):
                    served = self._load_run(job.blocks, wanted, loaded)
                    loaded += served.done
                    if not served.more:
                        break
        except Exception as exc:  # noqa: BLE001 - a failed load is recomputed, never fatal
            log.warning("kvtier load for %s failed (%s); vLLM recomputes it", job.req_id, exc)
        failed = {p for t in job.blocks[loaded:] for p in t.page_ids}
        with self._lock:
            self.stats.load_seconds += time.perf_counter() - start
            self.stats.loaded_blocks += loaded
            self.stats.failed_pages += len(failed)
        return failed

    def _load_run(self, transfers: list[BlockTransfer], keys: list[BlockKey], i: int) -> "_Served":
        """Load blocks ``i..`` of a run: those the host pool holds straight from it (pinned,
        no staging copy), else the run of blocks it lacks through the store (which finds
        them below, verifies them and promotes them in the background) via staging."""
        host = self.direct_host
        nbytes = self.paged.block_nbytes
        if host is not None:
            done = 0
            with host.borrow_many(keys[i:], nbytes) as views:
                for view in views:
                    self.paged.scatter(view, transfers[i + done])
                    done += 1
            if done:
                return _Served(done, True)
        j = i + 1
        while j < len(keys) and not (host is not None and host.contains(keys[j])):
            j += 1
        staging = self._buffers.take(j - i)

        def scatter(ready: list[int], payloads: list[np.ndarray]) -> None:
            # As each block is verified, from where its tier holds it then (a disk tier: its
            # reused staging, while it reads the next request). A block past a miss lands in
            # pages reported failed: vLLM recomputes them.
            for k, payload in zip(ready, payloads):
                self.paged.scatter(payload, transfers[i + k])

        try:
            result = self.store.get(keys[i:j], staging, promote_in_background=True, on_ready=scatter)
        finally:
            self._buffers.give(staging)
        return _Served(result.loaded, result.loaded == j - i)

    def finished_loads(self, wait_s: float = 0.0) -> set[str]:
        """Requests whose asynchronous loads ended (well or not) since the last call.

        With ``wait_s``, first wait that long at most for one in-flight load to end.
        """
        if wait_s and self._inflight:
            wait(list(self._inflight.values()), timeout=wait_s, return_when=FIRST_COMPLETED)
        done = {req_id for req_id, fut in self._inflight.items() if fut.done()}
        for req_id in done:
            self._load_errors |= self._inflight.pop(req_id).result()
        return done

    def take_load_errors(self) -> set[int]:
        """Pages loads left unfilled since the last call: this step's report. A report with any
        (an asynchronous load's too) stops saves until the scheduler has taken it, as the
        scheduler rewinds the saves of every step built before it took a failure's report."""
        errors, self._load_errors = self._load_errors, set()
        if errors:
            self._failed_step = max(self._failed_step, self.step)
        return errors

    # -- saves -----------------------------------------------------------------------
    def save(self, meta: KvtierMetadata) -> None:
        """Hand the step's new blocks to the store, unless a failed load spoiled the step on any
        worker (``_failed_step``, agreed in :meth:`start_loads`)."""
        if self.paged is None:
            return
        self._saves = [f for f in self._saves if not f.done()]
        self._note_adapter_drops(meta)   # reported even in a step a failed load spoiled
        # Spoiled by a failed load: vLLM ran this step's forward over pages a synchronous load left
        # unfilled. The load was of this step, or of an earlier one whose report the scheduler had
        # not taken when it built this step (more than one batch in flight: async scheduling,
        # pipeline parallelism; the request's next chunk ran over them). vLLM learns of the failure
        # from that step's report and recomputes; the KV computed meanwhile is wrong, and saved it
        # would be served under the blocks' real keys. Every save of the step goes (another
        # request may read those pages through vLLM's prefix cache): the scheduler rewinds them
        # all when it takes the report, and plans them again.
        spoiled = meta.reported_step < self._failed_step
        for job in meta.saves:
            if job.adapter_files is not None and \
                    self._adapter_drop_steps.get(job.adapter_files.directory, -1) > meta.reported_step:
                self._drop_adapter_save(job)
            elif spoiled:
                self.stats.saves_dropped += len(job.blocks)
            else:
                self._save(job, meta.epoch)

    def _note_adapter_drops(self, meta: KvtierMetadata) -> None:
        """Note the adapters whose files may not have held the version this step's saves name
        while vLLM ran it (:class:`WorkerAdapterCheck`). Every save of such an adapter goes, in this
        step and in each later one the scheduler built before it took this step's report: with
        ``load_inplace`` the pages computed meanwhile are another version's, and a request's later
        blocks attend to them, as do those of the requests vLLM serves them from its prefix cache
        (under the adapter's name and path) until the scheduler, told of the drop, marks them."""
        self._adapter_drop_steps = {directory: step for directory, step in self._adapter_drop_steps.items()
                                    if step > meta.reported_step}
        held: dict[tuple, bool] = {}   # each adapter's files checked once a step
        for job in meta.saves:
            if job.adapter_files is None:
                continue
            question = (job.adapter_files, job.adapter, job.adapter_since_step)
            if question not in held:
                held[question] = self._adapters.held(*question, meta.step)
            if not held[question]:
                self._adapter_drop_steps[job.adapter_files.directory] = meta.step

    def _drop_adapter_save(self, job: SaveJob) -> None:
        self.stats.adapter_saves_dropped += len(job.blocks)
        self._adapter_drop_dirs.add(job.adapter_files.directory)
        first = job.blocks[0].index
        self._adapter_drops[job.req_id] = min(first, self._adapter_drops.get(job.req_id, first))

    def report(self) -> KvtierWorkerMetadata:
        """This step's report to the scheduler (vLLM's ``build_connector_worker_meta``): its step,
        the host tier's changes (:meth:`host_report`), and the LoRA saves dropped since the last
        report, which the scheduler neither announces nor saves over."""
        drops, self._adapter_drops = self._adapter_drops, {}
        self._hold_drop_windows_to(self.step)
        return KvtierWorkerMetadata(self.step, self.host_report(), drops)

    def _hold_drop_windows_to(self, report_step: int) -> None:
        """Keep the drop window of each adapter dropped since the last report open until the
        scheduler has taken this report (of ``report_step``), which carries the drops: with
        speculative decoding vLLM builds a step's report before that step's save, so a drop is
        reported a step late, and the steps built meanwhile save over the dropped pages."""
        for directory in self._adapter_drop_dirs:
            self._adapter_drop_steps[directory] = max(self._adapter_drop_steps.get(directory, report_step),
                                                      report_step)
        self._adapter_drop_dirs = set()

    def _save(self, job: SaveJob, epoch: str = "") -> None:
        keys = self.engine.keys(job.hashes, epoch, job.adapter)
        staging = self._buffers.take(len(job.blocks))
        for buf, transfer in zip(staging, job.blocks):
            self.paged.gather(transfer, buf)
        indexes = [t.index for t in job.blocks]
        meta = BlockMeta(self.engine.layout.dtype, self.paged.block_shape, self.engine.block_tokens)
        saved = [keys[i] for i in indexes]
        if self.residency is not None:
            self.residency.saving(saved, [job.hashes[i] for i in indexes], epoch)
        future = self.store.put_async(
            saved,
            staging,
            parents=[keys[i - 1] if i else None for i in indexes],
            metas=[meta] * len(indexes),
        )
        # What flush() waits for: the put, then its accounting (a put's own future is done before
        # its callbacks run, so a flush that returned could still miss the save's stats and report).
        accounted: Future = Future()

        def account(put: Future) -> None:
            try:
                self._saved(put, saved)
                self._buffers.give(staging)
            finally:
                accounted.set_result(None)

        future.add_done_callback(account)
        self._saves.append(accounted)

    def _saved(self, future: Future, keys: list[BlockKey]) -> None:
        try:
            statuses = future.result()
        except Exception as exc:  # noqa: BLE001 - a lost save is a future miss
            log.warning("kvtier save failed (%s)", exc)
            with self._lock:
                self.stats.save_failures += 1
            statuses = None
        else:
            with self._lock:
                self.stats.saved_blocks += sum(s is Status.OK for s in statuses)
                self.stats.save_failures += sum(s is not Status.OK for s in statuses)
        if self.residency is not None:
            self.residency.saved(keys, statuses)

    def host_report(self) -> HostReport:
        """The host tier's changes to this worker's saved blocks since the last call (empty
        without a residency): this step's part of the report to the scheduler."""
        return self.residency.take() if self.residency is not None else {}

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait (at most ``timeout_s``) for every save and load submitted so far; True if all ended."""
        _, pending = wait(list(self._saves) + list(self._inflight.values()), timeout=timeout_s)
        return not pending

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Let submitted saves reach the store (bounded: the engine is going away), stop the loader."""
        if not self.flush(timeout_s):
            log.warning("kvtier: saves still running after %.1fs at shutdown; the store's bounded close takes over",
                        timeout_s)
        self._loader.shutdown(wait=False, cancel_futures=True)
        if self.residency is not None:
            self.residency.close()
