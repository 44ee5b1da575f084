"""The adapter of a LoRA request's block keys: its adapter's files and the engine's LoRA settings.

vLLM hashes a LoRA request's blocks with ``("lora", name, path)``, never the adapter's contents.
Its own prefix cache dies with the process that loaded the files; kvtier's store outlives it (a
disk tier) and is shared between hosts (a kvtier server, Mooncake). Keyed by name and path alone,
an adapter retrained in place (same name and path, new files) would be served its old version's
KV after a restart, and a host holding other files at the same path another host's: wrong tokens,
silently. So the keys of each request that carries a ``lora_request`` are rooted in a namespace
whose ``adapter`` (:attr:`kvtier.core.namespace.Namespace.adapter`) names

* the contents of the files vLLM loads from the adapter's directory (``adapter_config.json`` and
  the weights file it picks: ``adapter_model.safetensors``, else ``.bin``, else ``.pt``), every
  byte hashed (SHA-256, :mod:`kvtier.integrations.transformers.weights_hash`), once per version of
  the files: :class:`AdapterKeys` remembers a digest under the files' identity on this host (real
  path, device, inode, size, mtime and ctime; any write changes the ctime). Each file is read
  through the real path its identity records, and only while the file open is that very file
  (checked before reading and after each chunk): a link to the directory flipped to other files
  and back while they are read cannot give one version's digest to the other's files, and a file
  being written fails at its first chunk, not after its last byte;
* the engine's LoRA settings that change what an adapter computes (:func:`lora_settings`):
  ``lora_dtype`` above all (the same adapter computes other V in bfloat16 than in float32).

Requests without an adapter keep their keys (the namespace's ``adapter`` stays ""): base-model
blocks are shared by engines with and without LoRA, whose base KV is the same.

An adapter whose files cannot be read here (a hub name vLLM downloads itself, a path missing on
this host, files rewritten while hashed) has no identity: kvtier neither serves nor stores that
request's KV (a miss, logged once per adapter), rather than key it by its name. A directory whose
files changed while hashed (an upload in place) is not read again for ``CHANGING_RETRY_S``: each
request of it would otherwise re-read the partial files on the scheduler's thread.

vLLM's worker reads an adapter's files only when it loads its ``lora_int_id`` (at the id's first
request, again after its LRU evicted it, and at every step of a request with ``load_inplace``), and
computes the id's other requests with what it read then. So the scheduler names a request by the
version its id was first named with (:meth:`AdapterKeys.for_request`): files replaced under a
loaded id and requested without ``load_inplace`` are still computed with the old weights, and
such a request is neither served nor stored (logged once), nor, once that other version has stood
``SETTLED_S`` (long enough for vLLM to have loaded it at an eviction), any later one of that id
without ``load_inplace`` (vLLM's evictions are not seen here, so which version it holds under the
id is not known any more). Files caught while being written (the same bytes copied over
themselves, a backup restored) refuse only the requests that see them: once they name the id's
version again, its requests are served and stored again.

The scheduler side names a request's adapter once, at its first lookup (it alone sees the
request), and hands the name to the workers with each load and save (``LoadJob.adapter``,
``SaveJob.adapter``), so both key alike. The name holds only while vLLM computes with the files
it was named from, and vLLM reads them again while a request runs (after an unload, and at every
step with ``load_inplace``): so the files' identities as they were named (:class:`AdapterFiles`,
a few ``stat`` calls) are checked again before each save is planned, and by the worker after vLLM
loaded the step's adapters (``SaveJob.adapter_files``, :class:`WorkerAdapterCheck`). The worker
saves where the files were not written since they were named, their ctime alone moved (a
``chmod``), and drops the step's saves at any other change, a ``touch`` or the same bytes deployed
again too: matching contents cannot show that no other version came and went within the step (with
``load_inplace`` vLLM computed with what the files held at its start). A worker on another node
holds its own copy, whose identities are not the scheduler's: it checks the step against its own
baseline of that copy instead. The worker reports its drops (``KvtierWorkerMetadata.adapter_dropped``):
the scheduler cannot always see the change (a link flipped away and back), and stops that request's
saves and announcements. A request whose adapter's files changed or were written while it ran saves
nothing more: its later KV may be another version's, or attend to it.

vLLM's own prefix cache keys an adapter's pages by name and path only: after the files are
replaced in place, it gives the new version's requests the old version's pages (and the old
version's, at a rollback, the new one's), in this process. :class:`AdapterKeys` remembers which
version vLLM computed under each name and path since that cache was last reset (it sees the
resets through vLLM's block pool, :meth:`AdapterKeys.watch_prefix_cache`); once a second version
is named there, or a request that could not be named computed there with a version not known
(its id's is not known either: a request that could not be named computes with the version its id
was named with, if known), a request that vLLM serves from its prefix cache under that name and
path is not saved (its pages may be another version's), until the cache is reset. A change of the files' identity alone (a
``chmod``, a ``touch``, the same bytes deployed again) names the same version again: nothing is
replaced; but files written while a ``load_inplace`` request of the name and path runs (another
version, then the old bytes back) may have given it another version's pages: each lookup of the
name and path first checks its live requests' files, so those pages are marked before they are
reused, and so does a drop a worker reports.

Hashing runs on the scheduler's thread, once per adapter version (about a second a GB). To
replace an adapter's files: under a new id (vLLM's ``/v1/load_lora_adapter`` after an unload),
with ``load_inplace``, or across a restart; then reset vLLM's prefix cache (``POST
/reset_prefix_cache``), or every request of the adapter that vLLM serves from it goes unsaved
until the next reset; or put the new version at a new path, which needs neither. Requests in
flight during the replacement save nothing more.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import socket
import threading
import time
import weakref
from collections import OrderedDict
from typing import Any, NamedTuple

from kvtier.errors import ConfigError
from kvtier.integrations.transformers import weights_hash

log = logging.getLogger(__name__)

#: the adapter configuration vLLM reads (``PEFTHelper.from_local_dir``)
CONFIG_FILE = "adapter_config.json"
#: the weights files vLLM 0.32 reads, the first present wins (``LoRAModel.from_local_checkpoint``)
WEIGHTS_FILES = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")

#: LoRAConfig fields that change no adapter's KV; every other field is digested (a field kept
#: wrongly costs misses between engines, one dropped wrongly a wrong hit). Kept though measured
#: bit-identical on vLLM's CPU backend: ``max_lora_rank``, the padded rank GPU kernels tile over.
_NOT_COMPUTATION = frozenset({
    "max_loras",              # adapters in one batch: slots, as batch composition
    "max_cpu_loras",          # adapters kept in host memory
    "specialize_active_lora",  # CUDA graphs captured per count of active adapters
    "default_mm_loras",       # which adapter a multimodal request gets: its lora_request says so
    "max_lora_cls_labels",    # classification heads' output, past the hidden states: no KV
})


def lora_settings(vllm_config) -> dict[str, Any] | None:
    """The engine's LoRA settings that change what an adapter computes; None without LoRA.

    ``lora_dtype`` ``auto`` is the model's dtype (as vLLM resolves it), so ``auto`` on a float32
    model and an explicit float32 name one computation."""
    lora = getattr(vllm_config, "lora_config", None)
    if lora is None:
        return None
    settings = {f.name: getattr(lora, f.name) for f in dataclasses.fields(lora) if f.name not in _NOT_COMPUTATION}
    dtype = settings.get("lora_dtype")
    if dtype in (None, "auto"):
        dtype = vllm_config.model_config.dtype
    settings["lora_dtype"] = str(dtype).removeprefix("torch.")
    if settings.get("target_modules"):
        settings["target_modules"] = sorted(settings["target_modules"])
    return settings


def adapter_dir(lora_path: str) -> str | None:
    """The local directory vLLM loads an adapter from (``get_adapter_absolute_path``, without its
    hub download): an absolute path, ``~`` expanded, a relative path that exists; None for a name
    vLLM would download (this process cannot tell which files that gives)."""
    if os.path.isabs(lora_path):
        return lora_path
    if lora_path.startswith("~"):
        return os.path.expanduser(lora_path)
    if os.path.exists(lora_path):
        return os.path.abspath(lora_path)
    return None


def adapter_files(directory: str) -> list[str]:
    """The files vLLM reads of the adapter in ``directory``: its config, then its weights file.
    Raises OSError where either is missing (vLLM would refuse the adapter too)."""
    config = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(config):
        raise FileNotFoundError(f"no {CONFIG_FILE} in {directory}")
    for name in WEIGHTS_FILES:
        weights = os.path.join(directory, name)
        if os.path.isfile(weights):
            return [config, weights]
    raise FileNotFoundError(f"no adapter weights ({', '.join(WEIGHTS_FILES)}) in {directory}")


class _Digest(NamedTuple):
    stamps: tuple[tuple, ...]  #: each file's identity when it was hashed
    digest: str
    #: the files named from it: one object for every request named from this version, so a check
    #: of the live requests of an adapter stats each version's files once (``SchedulerSide``)
    files: AdapterFiles


class AdapterFiles(NamedTuple):
    """The files an adapter was named from, as they were then: its directory and each file's
    identity (real path, device, inode, size, mtime, ctime), on the file view (:func:`file_view`)
    that named them. Strings and ints: it travels to the workers with each save
    (``SaveJob.adapter_files``)."""

    directory: str
    stamps: tuple[tuple, ...]
    view: str = ""

    def unchanged(self) -> bool:
        """The directory still holds these very files (a few ``stat`` calls, nothing read); False
        where they cannot be read."""
        try:
            return _stamps(_current_files(self.directory)) == self.stamps
        except OSError:
            return False


def unwritten_between(named: AdapterFiles, now: AdapterFiles) -> bool:
    """``now`` are the very files ``named`` (real path, device, inode), with the same size and mtime:
    nothing was written to them in between, only their ctime may have moved. (A tool that sets the
    mtime back, ``rsync -t --inplace``, ``cp -p`` over the files, passes for no write.)"""
    return [_without_ctime(stamp) for stamp in named.stamps] == [_without_ctime(stamp) for stamp in now.stamps]


def _without_ctime(stamp: tuple) -> tuple:
    return tuple(item for item in stamp if item[0] != "ctime_ns")


class AdapterName(NamedTuple):
    """A request's adapter as its keys name it (:meth:`AdapterKeys.name`)."""

    #: "" for a request without an adapter; None where its files cannot be read
    key: str | None
    #: the files ``key`` was named from; None without an adapter or a key
    files: AdapterFiles | None


#: how an adapter's key starts (:meth:`AdapterKeys.name`); a JSON object follows
KEY_PREFIX = "vllm-lora/1 "


def files_digest(key: str) -> str | None:
    """The digest of the adapter's files that ``key`` names (:meth:`AdapterKeys.name`); None for a
    key of no adapter's files."""
    if not key.startswith(KEY_PREFIX):
        return None
    try:
        digest = json.loads(key[len(KEY_PREFIX):]).get("files")
    except (ValueError, AttributeError):
        return None
    return digest if isinstance(digest, str) else None


def _newest_change_ns(files: AdapterFiles) -> int:
    """When any of the files last changed (ctime: set by the kernel at every write, rename or
    chmod, which no tool sets back)."""
    return max(dict(stamp)["ctime_ns"] for stamp in files.stamps)


def _inodes(files: AdapterFiles) -> tuple[tuple, ...]:
    """Which files these are (real path, device, inode), whatever their contents."""
    return tuple((dict(stamp)["path"], dict(stamp)["dev"], dict(stamp)["ino"]) for stamp in files.stamps)


class _Unsettled(NamedTuple):
    """The version an id's files held while young (:data:`SETTLED_S`) when last seen: files being
    written. Contents, not ctimes, tell how long a version stood: a ``chmod`` moves the ctime and
    changes nothing vLLM reads."""

    key: str                      #: the version they held when last seen
    since_ns: int                 #: their newest ctime when that version was first seen
    inodes: tuple[tuple, ...]     #: which files they were (:func:`_inodes`)


def _replaced_young(seen: _Unsettled, files: AdapterFiles) -> bool:
    """``files`` are the very files ``seen`` (inodes), last changed less than :data:`SETTLED_S` after
    the version ``seen`` was first seen: it stood less than that (it ended at a write no later than
    their newest ctime), and so did whatever they held between."""
    return seen.inodes == _inodes(files) and _newest_change_ns(files) - seen.since_ns < SETTLED_S * 1e9


#: adapter versions whose digests are remembered, the least recently named dropped first (named
#: again, hashed again): an engine serves a handful at a time (``max_cpu_loras``)
MAX_ADAPTERS = 1024
#: adapter names and paths whose versions in vLLM's prefix cache are remembered (a few hundred
#: bytes each); past it, a name and path not remembered counts as holding several versions
MAX_CACHED_NAMES = 65536
#: what vLLM's prefix cache holds under a name and path that more than one version (or one not
#: known) computed under; and the version of a ``lora_int_id`` vLLM may hold either of
MIXED = "mixed"
#: why a request naming another version than its id's is refused, where it stood settled
REPLACED = "replaced in place"
#: lora_int_ids whose loaded version is remembered, the least recently named dropped first. vLLM's
#: worker keeps at most ``max_cpu_loras`` adapters loaded, evicting the least recently used too:
#: an id forgotten here was evicted there long before, and is read from its files again at its next
#: request. (A pinned adapter, which vLLM never evicts, unused while this many others were named is
#: the exception.)
MAX_LOADED_IDS = 65536
#: seconds another version of an id's files must have stood unchanged before it counts as one vLLM
#: may have loaded under the id (at an eviction, not seen here). Younger files are taken for files
#: being written (``cp`` of the same bytes over themselves, a backup restored, ``rsync --inplace``):
#: they refuse the request that sees them, but the id keeps its version if the same files (inodes)
#: name it again, each version seen replaced within this time of its first sighting (each stood less
#: than that; contents, not ctimes, are followed: a ``chmod`` moves the ctime of a version that
#: stands; :meth:`AdapterKeys.for_request`). A version first seen only after chmods moved its ctime
#: is counted from that ctime, not from its write.
#: vLLM loads no truncated file, so a copy caught half way is no version it could hold; what this
#: rule cannot see is a whole other version that vLLM loaded at an eviction within this time of its
#: write, then written back to the old bytes in the same files within this time too. File times
#: come from the file system's clock: one ahead of this host's makes settled files look young (their
#: requests are refused all the same, only the id is not marked), one behind makes them settled.
SETTLED_S = 5.0
#: seconds an adapter directory whose files changed while they were hashed is not read again:
#: an upload in place would otherwise cost every request of the adapter a read of the partial
#: files on vLLM's scheduler thread, which every request waits on
CHANGING_RETRY_S = 1.0


class _Said:
    """Subjects already logged, at most ``limit`` (the oldest forgotten, then logged again)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._subjects: OrderedDict[str, None] = OrderedDict()

    def first_time(self, subject: str) -> bool:
        if subject in self._subjects:
            return False
        self._subjects[subject] = None
        if len(self._subjects) > self.limit:
            self._subjects.popitem(last=False)
        return True


class _PrefixCacheResets:
    """Says whether vLLM's prefix cache was reset since it was last asked. vLLM tells a connector of
    a reset only when it resets the connector's cache too (``reset_cache``, which also draws kvtier
    a new key epoch); its block pool replaces its map of cached pages (``cached_block_hash_to_block``)
    with a new one at every reset, and at no other time. Without a pool (never bound, or one
    without that map) no reset is ever seen."""

    def __init__(self) -> None:
        self._pool = None
        self._map: weakref.ref | None = None   # weak: the pool drops its old map at a reset

    def watch(self, block_pool) -> None:
        current = getattr(block_pool, "cached_block_hash_to_block", None)
        try:
            self._map = weakref.ref(current)
        except TypeError:   # no map, or one that takes no weak reference: resets stay unseen
            log.info("kvtier: cannot tell when vLLM's prefix cache is reset (block pool %s)", type(block_pool))
            return
        self._pool = block_pool

    def seen(self) -> bool:
        if self._pool is None:
            return False
        current = self._pool.cached_block_hash_to_block
        if self._map() is current:
            return False
        self._map = weakref.ref(current)
        return True


class AdapterKeys:
    """The ``adapter`` of a request's keys (:meth:`of`, :meth:`name`), and which adapter versions
    vLLM's prefix cache holds pages of (:meth:`note_in_prefix_cache`). Thread safe.

    ``settings``: :func:`lora_settings` of the engine. :attr:`adapters_hashed` counts the adapter
    versions actually read (not those found remembered)."""

    def __init__(self, settings: dict[str, Any] | None) -> None:
        try:
            json.dumps(settings, sort_keys=True)
        except (TypeError, ValueError) as exc:   # at start-up, not at a LoRA request's lookup
            raise ConfigError(f"KvtierConnector cannot key LoRA requests on this engine's LoRA settings ({exc}); "
                              f"run LoRA without the connector") from exc
        self.settings = settings
        self.adapters_hashed = 0
        self._lock = threading.Lock()
        #: adapter directory → its last version's digest, the least recently named first
        self._digests: OrderedDict[str, _Digest] = OrderedDict()
        self._unreadable = _Said(MAX_ADAPTERS)
        #: (lora_name, lora_path), as vLLM hashes a request's pages → the one adapter version (key)
        #: vLLM computed under it since its prefix cache was last reset, or MIXED
        self._in_prefix_cache: OrderedDict[tuple[str, str], str] = OrderedDict()
        #: an entry of _in_prefix_cache was dropped since the last reset: a pair not in it may be MIXED
        self._forgot_some = False
        self._resets = _PrefixCacheResets()
        #: lora_int_id → the key it was first named with, the version vLLM's worker loaded under it
        #: (MIXED: not known), the least recently named first
        self._loaded: OrderedDict[int, str] = OrderedDict()
        #: lora_int_id → the files being written it was last named from (:data:`SETTLED_S`)
        self._unsettled: OrderedDict[int, _Unsettled] = OrderedDict()
        #: each key named lately, as the one string every id and name and path remembered shares
        #: (a key is some 350 bytes: a copy per id cost 65536 ids some 30 MB)
        self._keys: OrderedDict[str, str] = OrderedDict()
        self._not_loaded = _Said(MAX_ADAPTERS)   # (id, key) refused, logged once
        #: adapter directory → when its files were last found changing while hashed
        self._changing: OrderedDict[str, float] = OrderedDict()

    def of(self, lora_request) -> str | None:
        """"" for a request without an adapter (its keys as ever); the adapter's identity for one
        with; None where its files cannot be read (the request is neither served nor stored)."""
        return self.name(lora_request).key

    def name(self, lora_request) -> AdapterName:
        """:meth:`of`, with the files the adapter was named from, to check before each save."""
        if lora_request is None:
            return AdapterName("", None)
        try:
            directory = adapter_dir(lora_request.lora_path)
            if directory is None:
                raise FileNotFoundError(f"{lora_request.lora_path!r} is no local directory (a hub name?)")
            version = self._version(directory)
        except (OSError, ConfigError) as exc:
            with self._lock:
                first = self._unreadable.first_time(f"{lora_request.lora_name}\0{lora_request.lora_path}")
            if first:
                log.warning("kvtier: LoRA adapter %r (%s): cannot read its files (%s); its requests are neither "
                            "served nor stored by kvtier, nor, until vLLM's prefix cache is reset, those of its "
                            "requests that vLLM serves from that cache", lora_request.lora_name,
                            lora_request.lora_path, exc)
            return AdapterName(None, None)
        identity = {"files": version.digest, "settings": self.settings}
        if getattr(lora_request, "is_3d_lora_weight", False):
            identity["moe_3d_weights"] = True   # how vLLM reads the MoE weights of the same files
        key = KEY_PREFIX + json.dumps(identity, sort_keys=True, separators=(",", ":"))
        return AdapterName(self._shared(key), version.files)

    def _shared(self, key: str) -> str:
        """The copy of ``key`` already remembered, if any: the maps keep one string per version,
        not one per id (one forgotten past ``MAX_ADAPTERS`` costs only a copy)."""
        with self._lock:
            shared = self._keys.setdefault(key, key)
            self._keys.move_to_end(key)
            if len(self._keys) > MAX_ADAPTERS:
                self._keys.popitem(last=False)
        return shared

    def for_request(self, lora_request) -> AdapterName:
        """:meth:`name` for a request vLLM computes: the version vLLM's worker holds under its
        ``lora_int_id``, which is the one the id was first named with, or the one named now for a
        request with ``load_inplace`` (vLLM reads the files again for it). A request naming another
        version under a known id is ``AdapterName(None, None)``, neither served nor stored (logged
        once): vLLM computes it with the old weights. From then on, which version vLLM holds under
        the id is not known (an eviction there reads the new files), until a ``load_inplace``;
        unless the files were being written (:meth:`_other_version`)."""
        named = self.name(lora_request)
        if not named.key:
            return named
        lora_id = lora_request.lora_int_id
        with self._lock:
            refused = self._refuse(lora_id, named, getattr(lora_request, "load_inplace", False))
            first = refused is not None and self._not_loaded.first_time(f"{lora_id}\0{named.key}")
        if refused is None:
            return named
        if first:
            log.warning("kvtier: LoRA adapter %r (%s): its files are not those vLLM loaded under its id %d "
                        "(%s). vLLM reads an adapter's files only when it loads its id, and computes its "
                        "requests with the old weights: kvtier neither serves nor stores requests of id %d%s. "
                        "Load new files under a new id (/v1/load_lora_adapter), with load_inplace, or restart",
                        lora_request.lora_name, lora_request.lora_path, lora_id, refused, lora_id,
                        " while they differ" if refused != REPLACED else "")
        return AdapterName(None, None)

    def _refuse(self, lora_id: int, named: AdapterName, load_inplace: bool) -> str | None:
        """Why vLLM does not compute a request of ``lora_id`` with the version ``named``, or None
        where it does, noting what the request tells of the id's version (caller holds the lock)."""
        loaded = self._loaded.get(lora_id)
        if loaded is None or load_inplace:   # vLLM reads the files now (or read them at registration)
            self._read_now(lora_id, named)
            return None
        if loaded == named.key:
            if self._written_back(lora_id, named.files):
                self._remember_loaded(lora_id, loaded)
                return None
            return self._mixed(lora_id)
        if loaded == MIXED:
            return REPLACED
        return self._other_version(lora_id, named)

    def _read_now(self, lora_id: int, named: AdapterName) -> None:
        """``named`` is the version of ``lora_id`` from now on (caller holds the lock), young files
        or not: vLLM loads whole files however young, and its server loaded the id's files when it
        was registered (``/v1/load_lora_adapter``, ``--lora-modules``: ``add_lora`` preloads them),
        not at its first request. Truncated files at that request (an upload in place caught part
        way), which vLLM cannot load, say the same: vLLM holds the version registered before them,
        or whatever it read at some point of the upload, so the version they hold once complete is
        none it is known to hold under the id (:meth:`_other_version`). (Whole files replaced
        between the registration and the first request are not seen: nor is the registration.)"""
        self._unsettled.pop(lora_id, None)
        self._remember_loaded(lora_id, named.key)

    def _other_version(self, lora_id: int, named: AdapterName) -> str:
        """The files of ``lora_id`` name another version than the one vLLM loaded under it. One that
        stood ``SETTLED_S`` may be what vLLM holds after an eviction: the id's version is not known
        any more. Younger ones are taken for files being written, and refuse this request only: a
        write caught half way names a version vLLM never loaded (a truncated file does not load), and
        one that stands is settled at a later request (caller holds the lock)."""
        since_ns = self._standing_since(lora_id, named)
        stood_ns = time.time_ns() - since_ns if since_ns is not None else None
        if stood_ns is None or stood_ns >= SETTLED_S * 1e9:
            return self._mixed(lora_id)
        # named now, before the bound below drops the least recently named id (not this one)
        self._loaded.move_to_end(lora_id)
        self._unsettled[lora_id] = _Unsettled(named.key, since_ns, _inodes(named.files))
        self._unsettled.move_to_end(lora_id)
        if len(self._unsettled) > MAX_ADAPTERS:   # its evidence forgotten: the id's version not known
            self._remember_loaded(self._unsettled.popitem(last=False)[0], MIXED)
        return f"being written: stood {stood_ns / 1e9:.2f} s"

    def _standing_since(self, lora_id: int, named: AdapterName) -> int | None:
        """Since when the id's files have held the version ``named``, as far as this can tell: its
        first sighting's ctime where it was seen last too (the same files), else the files' newest
        ctime. None where the version seen before it may have stood ``SETTLED_S``: other files than
        those (a link flipped to them? when those stopped being the id's files is not known from file
        times), or the same ones changed that long after it was first seen (caller holds the lock)."""
        seen = self._unsettled.get(lora_id)
        if seen is not None and seen.key == named.key and seen.inodes == _inodes(named.files):
            return seen.since_ns
        if seen is not None and not _replaced_young(seen, named.files):
            return None
        return _newest_change_ns(named.files)

    def _written_back(self, lora_id: int, files: AdapterFiles) -> bool:
        """The id's files name its version again: True where no other version stood ``SETTLED_S``
        since it was last named. Each version seen being written in between was replaced less than
        that after it was first seen, in those very files (:meth:`_other_version`), and so was the
        last one seen (caller holds the lock)."""
        seen = self._unsettled.pop(lora_id, None)
        return seen is None or _replaced_young(seen, files)

    def _mixed(self, lora_id: int) -> str:
        """vLLM may hold another version under ``lora_id`` (caller holds the lock)."""
        self._unsettled.pop(lora_id, None)
        self._remember_loaded(lora_id, MIXED)
        return REPLACED

    def digest(self, directory: str) -> str:
        """SHA-256 over the names and digests of the adapter's files: remembered while the files'
        identities stay, hashed again when one changes. Raises OSError where they cannot be read,
        ConfigError where they change while hashed."""
        return self._version(directory).digest

    def _version(self, directory: str) -> _Digest:
        files = _current_files(directory)
        stamps = _stamps(files)
        with self._lock:
            known = self._digests.get(directory)
            if known is not None and known.stamps == stamps:
                self._digests.move_to_end(directory)
                return known
            self._refuse_if_changing(directory)
        try:
            version = _Digest(stamps, _digest_of(files, stamps), AdapterFiles(directory, stamps, file_view()))
        except (OSError, ConfigError):
            with self._lock:
                self._note_changing(directory)
            raise
        with self._lock:
            self._digests[directory] = version
            self._digests.move_to_end(directory)
            if len(self._digests) > MAX_ADAPTERS:
                self._digests.popitem(last=False)
            self.adapters_hashed += 1
        return version

    def _refuse_if_changing(self, directory: str) -> None:
        """Raise ConfigError where the directory's files were found changing less than
        ``CHANGING_RETRY_S`` ago (caller holds the lock)."""
        since = self._changing.get(directory)
        if since is None:
            return
        age = time.monotonic() - since
        if age < CHANGING_RETRY_S:
            raise ConfigError(f"the adapter's files in {directory} were changing {age:.2f} s ago "
                              f"(not read again before {CHANGING_RETRY_S} s)")
        del self._changing[directory]

    def _note_changing(self, directory: str) -> None:
        """The directory's files could not be hashed (caller holds the lock)."""
        self._changing[directory] = time.monotonic()
        self._changing.move_to_end(directory)
        if len(self._changing) > MAX_ADAPTERS:
            self._changing.popitem(last=False)

    def _remember_loaded(self, lora_id: int, key: str) -> None:
        """vLLM's worker holds ``key`` under ``lora_id`` (caller holds the lock)."""
        self._loaded[lora_id] = key
        self._loaded.move_to_end(lora_id)
        if len(self._loaded) > MAX_LOADED_IDS:
            self._loaded.popitem(last=False)

    # -- vLLM's prefix cache ----------------------------------------------------------------------
    def watch_prefix_cache(self, block_pool) -> None:
        """Forget which versions vLLM's prefix cache holds whenever ``block_pool`` (the scheduler's,
        vLLM's ``bind_gpu_block_pool``) resets it. Unwatched, nothing is ever forgotten: a name and
        path once served two versions stays so for the process."""
        with self._lock:
            self._resets.watch(block_pool)

    def note_in_prefix_cache(self, lora_request, key: str) -> bool:
        """Note that a request of ``lora_request``, named ``key``, computes pages into vLLM's prefix
        cache, which keys them by the adapter's name and path. True where every page that cache
        holds under them since its last reset was computed under ``key``; False where another
        version of the adapter computed some (replaced in place): a prefix hit there may be its KV."""
        pair = (lora_request.lora_name, lora_request.lora_path)
        with self._lock:
            self._forget_if_reset()
            known = self._in_prefix_cache.get(pair)
            if known is None:
                known = MIXED if self._forgot_some else key
                self._remember(pair, known)
            else:
                self._in_prefix_cache.move_to_end(pair)
            if known in (key, MIXED):
                return known == key
            self._in_prefix_cache[pair] = MIXED
        log.warning("kvtier: LoRA adapter %r (%s) is served with other files than before (replaced in place). "
                    "vLLM's prefix cache keys an adapter's pages by its name and path only and may give a "
                    "request of one version the other's pages, so kvtier stores no request of this adapter "
                    "that vLLM serves from that cache until it is reset. After replacing an adapter's files in "
                    "place, reset vLLM's prefix cache (POST /reset_prefix_cache), or put the new version at a "
                    "new path", *pair)
        return False

    def replaced_while_running(self, lora_request, renamed: str | None) -> None:
        """The files of a running request's adapter changed, and name ``renamed`` now
        (:meth:`for_request`; None: refused, or not readable, e.g. being written). Its later pages
        in vLLM's prefix cache are of the version vLLM holds under its id (:meth:`computed_unnamed`).
        Where the new files were accepted under the id (vLLM may have read them, or not: it had
        loaded the old ones), which version it holds there is not known, unless its requests have
        vLLM read them at each step (``load_inplace``). A refusal marked the id already where the
        new files may be a version vLLM loaded; files not readable are none it could load."""
        with self._lock:
            if renamed is not None and lora_request.lora_int_id in self._loaded \
                    and not getattr(lora_request, "load_inplace", False):
                self._mixed(lora_request.lora_int_id)
        if self._computed_with_loaded(lora_request):
            log.warning("kvtier: LoRA adapter %r (%s): its files changed while requests ran; kvtier saves no "
                        "more of those requests, and no request of the adapter that vLLM serves from its "
                        "prefix cache until that cache is reset (POST /reset_prefix_cache)",
                        lora_request.lora_name, lora_request.lora_path)

    def computed_unnamed(self, lora_request) -> None:
        """A request of ``lora_request`` that could not be named (:meth:`for_request` None) computes
        pages into vLLM's prefix cache under its adapter's name and path all the same, with the
        weights vLLM holds under its id (logged by :meth:`name`)."""
        self._computed_with_loaded(lora_request)

    def _computed_with_loaded(self, lora_request) -> bool:
        """A request computed pages into vLLM's prefix cache with the version vLLM holds under its
        id: where that is known (and vLLM reads no files for it: no ``load_inplace``), noted for the
        adapter's name and path like a named request's; else the pages are of a version not known
        there. True where that made the name and path newly hold several versions, not warned of yet."""
        with self._lock:
            loaded = self._loaded.get(lora_request.lora_int_id)
        if loaded in (None, MIXED) or getattr(lora_request, "load_inplace", False):
            return self._mark_mixed(lora_request)
        self.note_in_prefix_cache(lora_request, loaded)   # warns itself where another version was there
        return False

    def _mark_mixed(self, lora_request) -> bool:
        """vLLM's prefix cache holds pages of a version not known under the adapter's name and path;
        True where it was not known to before."""
        pair = (lora_request.lora_name, lora_request.lora_path)
        with self._lock:
            self._forget_if_reset()
            known = self._in_prefix_cache.get(pair)
            self._remember(pair, MIXED)
        return known != MIXED

    def _forget_if_reset(self) -> None:
        """vLLM's prefix cache was reset: it holds no adapter's pages (caller holds the lock)."""
        if self._resets.seen():
            self._in_prefix_cache.clear()
            self._forgot_some = False

    def _remember(self, pair: tuple[str, str], version: str) -> None:
        """Note ``version`` for ``pair``, dropping the least recently noted pair past
        ``MAX_CACHED_NAMES`` (caller holds the lock)."""
        self._in_prefix_cache[pair] = version
        self._in_prefix_cache.move_to_end(pair)
        if len(self._in_prefix_cache) > MAX_CACHED_NAMES:
            self._in_prefix_cache.popitem(last=False)
            self._forgot_some = True


@functools.cache
def file_view() -> str:
    """Which files a path names from this process: its host's boot and its mount namespace (two
    containers of one host may hold other files at one path). Another host's file identities say
    nothing of this one's files."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/mnt').st_ino}"
    except OSError:   # not Linux: the host's name
        return f"host:{socket.gethostname()}"


#: seconds before a worker started by which its copy of an adapter's files must have last changed
#: for it to take them as what vLLM read at every step it ran: file times come from a coarse clock
#: (a tick behind), and some file systems keep whole seconds
WORKER_START_MARGIN_S = 2.0


class _LocalVersion(NamedTuple):
    """An adapter's files on a worker's file view, as it last hashed them."""

    files: AdapterFiles
    digest: str | None   #: None: they could not be hashed (unreadable, or changing meanwhile)
    seen_at: int         #: the step at whose save the worker hashed them (before the next one's reads)


class WorkerAdapterCheck:
    """A worker's check that vLLM computed a save job's blocks with the adapter version the job names
    (``SaveJob.adapter``). Called on the worker's thread only (not thread safe), at each step's save,
    after vLLM ran the step.

    Where the scheduler named the files on this worker's file view (:func:`file_view`), the very
    files it named (``SaveJob.adapter_files``: checked again before each save is planned), not
    written since, their ctime alone moved (a ``chmod``), held the version throughout: any other
    change drops the job, the same bytes written again too (another version may have come and gone
    meanwhile, and would hash alike).

    A worker on another host (multi-node tensor or pipeline parallelism: vLLM loads the adapter from
    the same path on every node) holds its own copy, whose identities are never the scheduler's. It
    hashes its own files (once per identity, on its thread: about a second a GB) and takes the
    version as held where they name it and

    * they last changed ``WORKER_START_MARGIN_S`` before the worker started: vLLM read them at each
      step it ran, for the request's own pages and for those its prefix cache serves; or
    * it saw those very files, not written since, at the save of a step before the job's request
      began (``SaveJob.adapter_since_step``): vLLM reads a step's adapters after the previous step's
      save. A request that began before that computed across a write not seen (its job is dropped,
      and, reported, marks the pages of its adapter in vLLM's prefix cache).

    Once it has seen a directory's files name another version than a job's, it never vouches for
    that directory again while it runs: without ``load_inplace`` vLLM loads an adapter id once and
    keeps it in its LoRA cache, so files fixed later say nothing of the weights it computes with.

    Anything else is no proof: the job is dropped (a miss, never another version's KV). Files
    written on one host and not the others (a link flipped away and back between two checks on
    either) are not seen."""

    def __init__(self) -> None:
        #: adapter directory → its files here as last hashed, the least recently checked first
        self._local: OrderedDict[str, _LocalVersion] = OrderedDict()
        self._started_ns = time.time_ns()
        #: directories whose files here once named another version than a job's: vLLM may hold that
        #: version in its LoRA cache for good (no ``load_inplace``: it never reads the files again),
        #: so no later sight of the files proves what it computes with. One path each, never
        #: forgotten (forgetting one would let it vouch again).
        self._disowned: set[str] = set()

    def held(self, named: AdapterFiles, key: str, since_step: int, step: int) -> bool:
        """vLLM computed the blocks of a request that began at ``since_step``, up to ``step`` (whose
        save this is), with the version ``key`` names, read from the files ``named`` (as the
        scheduler named them)."""
        try:
            paths = _current_files(named.directory)
            here = AdapterFiles(named.directory, _stamps(paths), file_view())
        except OSError:
            return False
        if named.view == here.view:   # the very files the scheduler named, unwritten since
            return unwritten_between(named, here)
        if here.directory in self._disowned:
            return False
        local = self._local_version(paths, here, step)
        if local.digest is None:
            return False
        if local.digest != files_digest(key):
            self._disowned.add(here.directory)
            return False
        # (the ctime when hashed: a chmod since, which moves it, changes nothing vLLM reads)
        return _newest_change_ns(local.files) < self._started_ns - WORKER_START_MARGIN_S * 1e9 \
            or local.seen_at < since_step

    def _local_version(self, paths: list[str], here: AdapterFiles, step: int) -> _LocalVersion:
        """This host's version of the files ``here``: remembered while they are not written (a
        ``chmod`` keeps it), else hashed now."""
        known = self._local.get(here.directory)
        if known is not None and unwritten_between(known.files, here):
            self._local.move_to_end(here.directory)
            return known
        try:
            digest = _digest_of(paths, here.stamps)
        except (OSError, ConfigError):
            digest = None
        version = self._local[here.directory] = _LocalVersion(here, digest, step)
        self._local.move_to_end(here.directory)
        if len(self._local) > MAX_ADAPTERS:
            self._local.popitem(last=False)
        return version


def _current_files(directory: str) -> list[str]:
    """:func:`adapter_files` of the directory ``directory`` leads to now, resolved once: a link to
    it flipped meanwhile cannot mix one version's config with another's weights."""
    try:
        real = os.path.realpath(directory)
    except ValueError as exc:   # a NUL in the path: no file has that name
        raise FileNotFoundError(f"{directory!r} names no directory ({exc})") from exc
    return adapter_files(real)


def _stamp(real_path: str, st: os.stat_result) -> tuple:
    """A file's identity (``weights_hash.file_stamp``'s fields), from its ``stat``."""
    return tuple(sorted({"path": real_path, "dev": st.st_dev, "ino": st.st_ino, "size": st.st_size,
                         "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}.items()))


def _stamps(files: list[str]) -> tuple[tuple, ...]:
    return tuple(_stamp(real, os.stat(real)) for real in map(os.path.realpath, files))


def _digest_of(files: list[str], stamps: tuple[tuple, ...]) -> str:
    """SHA-256 over the names and digests of the files with these identities; ConfigError where
    one changed while read, or the directory holds others by the end."""
    top = hashlib.sha256()
    for path, stamp in zip(files, stamps):
        top.update(f"{os.path.basename(path)}\0{_hash_stamped(stamp)}\n".encode())
    if _stamps(files) != stamps:
        raise ConfigError(f"the adapter's files in {os.path.dirname(files[0])} changed while they were hashed")
    return top.hexdigest()


def _hash_stamped(stamp: tuple) -> str:
    """``weights_hash.hash_file``'s digest of the file ``stamp`` identifies, read through the real
    path it records and only while the file open is that very file, unchanged: checked before
    reading and after each chunk (a file being written fails at its first chunk)."""
    path, size = dict(stamp)["path"], dict(stamp)["size"]
    # a link put at the path since fails to open (O_NOFOLLOW), and a FIFO opens without waiting for
    # a writer (O_NONBLOCK; it then fails the check) rather than block the scheduler's thread
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        _require_stamp(fd, stamp)
        chunk_bytes = weights_hash.CHUNK_BYTES
        chunks = []
        for offset in range(0, size, chunk_bytes):   # hash_file's reads, with a check after each
            chunks.append(weights_hash._hash_chunk(fd, offset, min(chunk_bytes, size - offset)))
            _require_stamp(fd, stamp)
    finally:
        os.close(fd)
    # hash_file's layout (its size, then each chunk's digest): an adapter's key as before
    top = hashlib.new(weights_hash.HASH_NAME)
    top.update(size.to_bytes(8, "little"))
    for digest in chunks:
        top.update(digest)
    return top.hexdigest()


def _require_stamp(fd: int, stamp: tuple) -> None:
    path = dict(stamp)["path"]
    if _stamp(path, os.fstat(fd)) != stamp:
        raise ConfigError(f"{path} changed while it was hashed (not the file named, or written meanwhile)")
