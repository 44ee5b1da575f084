"""Whether a model's weights are still the ones its namespace names, checked at every request.

A namespace is fixed when a :class:`~.session.KVTierLM` is built; every block key derives from
it. Weights changed in place afterwards (an optimizer step between rollouts, PEFT's
``merge_and_unload()``, ``load_state_dict`` of another checkpoint) keep the same tensors, so
the old namespace would keep serving the old weights' K/V as the new model's. Hashing the
weights again (:func:`~.namespace.loaded_weights_digest`) reads every byte: a second for a
16 GB model, too much for each request. :class:`WeightsWatch` instead records, once, what
changes when a weight does, and compares it in one pass over the tensors the digest covers (the
parameters and persistent buffers: quantized layers such as BitNet's or GPTQ's hold their weights
as buffers) and over the state of PEFT's tuner layers (:func:`~.namespace.adapter_states`: which
adapter they apply, which no tensor says):

* the tensor objects and their names: a parameter replaced (``module.weight = Parameter(...)``);
* each one's ``data_ptr``: its ``.data`` set to another tensor (PEFT's safe merge), a conversion;
* each one's version counter, which torch bumps at every in-place write through the tensor
  or a view of it (optimizer steps, the ``copy_`` of ``load_state_dict``, any op under
  ``no_grad``);
* a few values read at spread positions: ``.data`` hands out a tensor with a version counter
  of its own, so writes through it (PEFT's merge, ``weight.data += delta``; older optimizers)
  bump nothing. A dense update (a merged LoRA, an optimizer step) changes every value read; a
  write through ``.data`` that spares every one of them goes unseen (one embedding row
  re-initialised through ``.data``, say): the watch is a cheap per-request check, not a proof.

The digest leaves out the non-persistent buffers (RoPE's ``inv_freq``: no checkpoint holds them),
yet they decide K/V as much as a weight: the watch records them the same way, and, when small
(:data:`WHOLE_BUFFER_ELEMENTS`, as ``inv_freq`` is), a copy of every value, so a write through
``.data`` is seen too; a rotary module rebuilt from a new RoPE config holds other buffer objects.
Their own digest (:func:`~.namespace.non_persistent_buffers_digest`) settles a change. So does the attention kernel the
config names (:func:`~.namespace.attention_implementation`: Gemma 2's eager kernel soft-caps,
sdpa does not), which the namespace names and ``set_attn_implementation`` changes with no tensor
touched: compared as it was at construction, never settled by a digest.

What changed need not be the weights' values: ``share_memory()`` moves the same bytes elsewhere,
a checkpoint may be loaded again. So a change seen is settled by the digests, once: the weights
the session was built with (the same digests) become the new record and are served, others are
refused until they change again. PEFT's ``merge_adapter()`` then ``unmerge_adapter()`` does not
give the base weights back bit for bit (float rounding): other weights, refused.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from kvtier.integrations.transformers.namespace import (
    adapter_state,
    attention_implementation,
    loaded_weights_digest,
    non_persistent_buffers_digest,
)

#: values read from each tensor at every check (one integer read each)
SAMPLES_PER_PARAMETER = 8
#: a non-persistent buffer of at most this many elements is compared whole at every check (one
#: vectorised compare: RoPE's ``inv_freq`` holds head_dim / 2 values); a larger one is sampled
WHOLE_BUFFER_ELEMENTS = 4096

# Integer views of the tensors' bytes: compared as integers, a NaN weight equals itself.
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _Recorded(NamedTuple):
    name: str
    tensor: torch.Tensor  #: held: its id and memory cannot be reused by another tensor meanwhile
    data_ptr: int
    version: int | None  #: None for inference tensors, which keep no version counter
    values: np.ndarray | None  #: an integer view of its bytes (None where numpy cannot see them)
    positions: tuple[int, ...]
    sample: tuple[int, ...]
    whole: np.ndarray | None  #: a copy of every value (small non-persistent buffers), else None


def _first_difference(kind: str, tensors: list[tuple[str, torch.Tensor]], recorded: list[_Recorded]) -> str | None:
    """What differs in ``tensors`` (named, as found now) from their records (the first difference, in
    words), or None. One loop, no call per tensor: it runs over every weight at every request."""
    if len(tensors) != len(recorded):
        return f"the model has {len(tensors)} {kind} tensors, {len(recorded)} when recorded"
    for (name, tensor), was in zip(tensors, recorded):
        if name != was.name or tensor is not was.tensor:
            return f"{kind} {name!r} was replaced"
        # (before the values are read: a view of memory the tensor has left may be freed)
        if tensor.data_ptr() != was.data_ptr:
            return f"{kind} {name!r} holds other memory (its .data was set, or it was converted or moved)"
        if _version(tensor) != was.version:
            return f"{kind} {name!r} was written in place"
        if _read(was.values, was.positions) != was.sample or (
                was.whole is not None and not np.array_equal(was.values, was.whole)):
            return f"{kind} {name!r} was written in place (through .data)"
    return None


def _version(param: torch.Tensor) -> int | None:
    return None if param.is_inference() else param._version


def _integer_view(param: torch.Tensor) -> np.ndarray | None:
    """A numpy view (no copy) of ``param``'s elements as integers of the same size, or None where
    there is none (a device other than the CPU, an element size without an integer type)."""
    int_dtype = _SAME_SIZE_INT.get(param.element_size())
    if int_dtype is None or param.device.type != "cpu":
        return None
    try:
        return param.detach().view(int_dtype).numpy()
    except (RuntimeError, TypeError):  # a layout numpy cannot take (sparse, quantized)
        return None


def _spread_positions(numel: int) -> tuple[int, ...]:
    """Up to :data:`SAMPLES_PER_PARAMETER` flat indices, first and last included, evenly spread."""
    if numel <= SAMPLES_PER_PARAMETER:
        return tuple(range(numel))
    last = SAMPLES_PER_PARAMETER - 1
    return tuple(i * (numel - 1) // last for i in range(SAMPLES_PER_PARAMETER))


def _read(values: np.ndarray | None, positions: tuple[int, ...]) -> tuple[int, ...]:
    return () if values is None else tuple(map(values.item, positions))


def _record(name: str, tensor: torch.Tensor, *, whole: bool = False) -> _Recorded:
    """``tensor`` as it is now; ``whole``: with a copy of every value if it is small."""
    values = _integer_view(tensor)
    positions = _spread_positions(tensor.numel()) if values is not None else ()
    copy = values.copy() if whole and values is not None and values.size <= WHOLE_BUFFER_ELEMENTS else None
    return _Recorded(name, tensor, tensor.data_ptr(), _version(tensor), values, positions, _read(values, positions),
                     copy)


class _ModelNow(NamedTuple):
    """What one pass over a model's modules finds, as it is now."""

    weights: list[tuple[str, torch.Tensor]]  #: the tensors of its state dict, each once
    buffers: list[tuple[str, torch.Tensor]]  #: its non-persistent buffers (RoPE's inv_freq), each once
    adapters: list[tuple[str, str]]  #: its PEFT tuner layers' state


def _model_now(model: torch.nn.Module) -> _ModelNow:
    """In one pass over ``model``'s modules: the tensors of its state dict (parameters and
    persistent buffers), its non-persistent buffers (which no checkpoint holds, but the forward
    reads) and its PEFT tuner layers' state."""
    weights: list[tuple[str, torch.Tensor]] = []
    buffers: list[tuple[str, torch.Tensor]] = []
    adapters: list[tuple[str, str]] = []
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        if (state := adapter_state(module)) is not None:
            adapters.append((prefix, state))
        non_persistent = module._non_persistent_buffers_set  # buffer names only: no parameter is in it
        for leaf, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is not None and id(tensor) not in seen:
                seen.add(id(tensor))
                name = f"{prefix}.{leaf}" if prefix else leaf
                (buffers if leaf in non_persistent else weights).append((name, tensor))
    return _ModelNow(weights, buffers, adapters)


class _Snapshot(NamedTuple):
    """What a check compares: each weight tensor and non-persistent buffer as recorded, and the PEFT
    tuner layers' state."""

    weights: list[_Recorded]
    buffers: list[_Recorded]
    adapters: list[tuple[str, str]]

    @classmethod
    def of(cls, model: torch.nn.Module) -> _Snapshot:
        now = _model_now(model)
        return cls([_record(name, t) for name, t in now.weights],
                   [_record(name, t, whole=True) for name, t in now.buffers], now.adapters)

    def change(self, model: torch.nn.Module) -> str | None:
        """What differs in ``model`` from this snapshot (the first difference found, in words), or None."""
        now = _model_now(model)
        difference = (_first_difference("weight", now.weights, self.weights)
                      or _first_difference("non-persistent buffer", now.buffers, self.buffers))
        if difference is not None:
            return difference
        if now.adapters != self.adapters:
            return "a PEFT tuner layer applies other adapters (set_adapter, disable_adapter_layers, merged, rescaled)"
        return None


class WeightsWatch:
    """The weights of ``model`` as they are now; :meth:`change` says whether they are other weights since.

    ``digest``: the :func:`~.namespace.loaded_weights_digest` of the weights now (computed here if not
    given). A check costs one pass over the modules and :data:`SAMPLES_PER_PARAMETER` integer reads
    per weight tensor, whatever their size (a small non-persistent buffer: one compare of its
    values): about 1 ms for the 291 parameters of a 32-layer Llama (a 7B's count) on a 2-core VM,
    more with PEFT layers (5-11 ms with LoRA on 7 projections of 32 layers: their ~2k submodules are
    walked); nothing is hashed while nothing changes. The walk over the modules, not a list kept, is
    what sees a module replaced (an adapter wrapped around a projection adds parameters, a rotary
    module rebuilt holds new buffers). A change seen costs one digest (a read of every weight), and
    one per later change: a session whose weights moved is not refused for that alone. Holds a
    reference to every tensor it recorded (a replaced one stays in memory as long as the watch
    does). Not thread safe: its owner calls it under its request lock.
    """

    def __init__(self, model: torch.nn.Module, digest: str | None = None) -> None:
        self._model = model
        self._attention = attention_implementation(model.config)
        self._recorded = _Snapshot.of(model)
        self._digest = digest if digest is not None else loaded_weights_digest(model)
        self._buffers_digest = non_persistent_buffers_digest(model)
        # The weights last found to be other ones, and why: refused again, unhashed, until they change.
        self._foreign: tuple[_Snapshot, str] | None = None

    def moved(self) -> str | None:
        """What differs from the model last found to be the namespace's (its attention kernel, then
        the first difference of its weights seen, in words), or None: a check without any digest,
        which may report weights moved or rewritten with the same bytes (:meth:`change` settles that)."""
        return self.attention_change() or self._recorded.change(self._model)

    def attention_change(self) -> str | None:
        """The attention kernel the model's config names now, in words, if it is not the one it
        named at construction; None while it is. Not settled by a digest: the namespace names the
        kernel, and another one computes other K/V."""
        attention = attention_implementation(self._model.config)
        if attention != self._attention:
            return f"it is {attention!r}, {self._attention!r} when built"
        return None

    def change(self) -> str | None:
        """What makes the weights other ones than at construction (the first change found, in
        words), or None while they are the same (moved or rewritten with the same bytes included).
        The attention kernel is :meth:`attention_change`'s."""
        change = self._recorded.change(self._model)
        if change is None:
            return None
        if self._foreign is not None and self._foreign[0].change(self._model) is None:
            return self._foreign[1]
        # Recorded before hashing: a write during the digest shows at the next check.
        now = _Snapshot.of(self._model)
        same_weights = loaded_weights_digest(self._model) == self._digest
        if same_weights and non_persistent_buffers_digest(self._model) == self._buffers_digest:
            self._recorded, self._foreign = now, None
            return None
        self._foreign = (now, change)
        return change
