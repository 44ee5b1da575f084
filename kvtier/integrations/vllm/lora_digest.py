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
  path, device, inode, size, mtime and ctime; any write changes the ctime);
* the engine's LoRA settings that change what an adapter computes (:func:`lora_settings`):
  ``lora_dtype`` above all (the same adapter computes other V in bfloat16 than in float32).

Requests without an adapter keep their keys (the namespace's ``adapter`` stays ""): base-model
blocks are shared by engines with and without LoRA, whose base KV is the same.

An adapter whose files cannot be read here (a hub name vLLM downloads itself, a path missing on
this host, files rewritten while hashed) has no identity: kvtier neither serves nor stores that
request's KV (a miss, logged once per adapter), rather than key it by its name.

The scheduler side names a request's adapter once, at its first lookup (it alone sees the
request), and hands the name to the workers with each load and save (``LoadJob.adapter``,
``SaveJob.adapter``): both key alike, whatever the files become meanwhile.

Hashing runs on the scheduler's thread, once per adapter version (about a second a GB). Limit: vLLM
keeps an adapter loaded under its ``lora_int_id``; files replaced under a running engine and
requested under the same id (without ``load_inplace``) are still computed with the old weights,
which kvtier would key by the new files. Replace an adapter's files under a new id (vLLM's
``/v1/load_lora_adapter`` after an unload), with ``load_inplace``, or across a restart.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import threading
from typing import Any, NamedTuple

from kvtier.errors import ConfigError
from kvtier.integrations.transformers.weights_hash import file_stamp, hash_file
from kvtier.store import safety

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


class AdapterKeys:
    """The ``adapter`` of a request's keys (:meth:`of`). Thread safe.

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
        self._digests: dict[str, _Digest] = {}   #: adapter directory → its last version's digest

    def of(self, lora_request) -> str | None:
        """"" for a request without an adapter (its keys as ever); the adapter's identity for one
        with; None where its files cannot be read (the request is neither served nor stored)."""
        if lora_request is None:
            return ""
        try:
            directory = adapter_dir(lora_request.lora_path)
            if directory is None:
                raise FileNotFoundError(f"{lora_request.lora_path!r} is no local directory (a hub name?)")
            digest = self.digest(directory)
        except (OSError, ConfigError) as exc:
            if safety.first_time("unreadable-lora", f"{lora_request.lora_name}\0{lora_request.lora_path}"):
                log.warning("kvtier: LoRA adapter %r (%s): cannot read its files (%s); its requests are neither "
                            "served nor stored by kvtier", lora_request.lora_name, lora_request.lora_path, exc)
            return None
        identity = {"files": digest, "settings": self.settings}
        if getattr(lora_request, "is_3d_lora_weight", False):
            identity["moe_3d_weights"] = True   # how vLLM reads the MoE weights of the same files
        return "vllm-lora/1 " + json.dumps(identity, sort_keys=True, separators=(",", ":"))

    def digest(self, directory: str) -> str:
        """SHA-256 over the names and digests of the adapter's files: remembered while the files'
        identities stay, hashed again when one changes. Raises OSError where they cannot be read,
        ConfigError where they change while hashed."""
        files = adapter_files(directory)
        stamps = self._stamps(files)
        with self._lock:
            known = self._digests.get(directory)
        if known is not None and known.stamps == stamps:
            return known.digest
        top = hashlib.sha256()
        for path in files:
            top.update(f"{os.path.basename(path)}\0{hash_file(path)}\n".encode())
        if self._stamps(files) != stamps:
            raise ConfigError(f"the adapter's files in {directory} changed while they were hashed")
        digest = top.hexdigest()
        with self._lock:
            self._digests[directory] = _Digest(stamps, digest)
            self.adapters_hashed += 1
        return digest

    @staticmethod
    def _stamps(files: list[str]) -> tuple[tuple, ...]:
        return tuple(tuple(sorted(file_stamp(path).items())) for path in files)
