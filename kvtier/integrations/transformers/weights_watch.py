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
  write through ``.data`` that spares every one of them goes unseen.

What changed need not be the weights' values: ``share_memory()`` moves the same bytes elsewhere,
a checkpoint may be loaded again. So a change seen is settled by the digest, once: the weights
the session was built with (the same digest) become the new record and are served, others are
refused until they change again.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from kvtier.integrations.transformers.namespace import adapter_state, loaded_weights_digest

#: values read from each tensor at every check (one integer read each)
SAMPLES_PER_PARAMETER = 8

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


def _record(name: str, tensor: torch.Tensor) -> _Recorded:
    values = _integer_view(tensor)
    positions = _spread_positions(tensor.numel()) if values is not None else ()
    return _Recorded(name, tensor, tensor.data_ptr(), _version(tensor), values, positions, _read(values, positions))


def _weights_now(model: torch.nn.Module) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, str]]]:
    """In one pass over ``model``'s modules, as they are now: the tensors of its state dict, each once
    (parameters and persistent buffers; not the non-persistent ones, such as RoPE's ``inv_freq``,
    which the model may recompute and no checkpoint holds), and its PEFT tuner layers' state."""
    tensors: list[tuple[str, torch.Tensor]] = []
    adapters: list[tuple[str, str]] = []
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        if (state := adapter_state(module)) is not None:
            adapters.append((prefix, state))
        non_persistent = module._non_persistent_buffers_set
        for leaf, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is not None and id(tensor) not in seen and leaf not in non_persistent:
                seen.add(id(tensor))
                tensors.append((f"{prefix}.{leaf}" if prefix else leaf, tensor))
    return tensors, adapters


class _Snapshot(NamedTuple):
    """What a check compares: each weight tensor as recorded, and the PEFT tuner layers' state."""

    tensors: list[_Recorded]
    adapters: list[tuple[str, str]]

    @classmethod
    def of(cls, model: torch.nn.Module) -> _Snapshot:
        tensors, adapters = _weights_now(model)
        return cls([_record(name, t) for name, t in tensors], adapters)

    def change(self, model: torch.nn.Module) -> str | None:
        """What differs in ``model`` from this snapshot (the first difference found, in words), or None."""
        now, adapters = _weights_now(model)
        if len(now) != len(self.tensors):
            return f"the model has {len(now)} weight tensors, {len(self.tensors)} when recorded"
        for (name, tensor), was in zip(now, self.tensors):
            if name != was.name or tensor is not was.tensor:
                return f"weight {name!r} was replaced"
            # (before the values are read: a view of memory the tensor has left may be freed)
            if tensor.data_ptr() != was.data_ptr:
                return f"weight {name!r} holds other memory (its .data was set, or it was converted or moved)"
            if _version(tensor) != was.version:
                return f"weight {name!r} was written in place"
            if _read(was.values, was.positions) != was.sample:
                return f"weight {name!r} was written in place (through .data)"
        if adapters != self.adapters:
            return "a PEFT tuner layer applies other adapters (set_adapter, disable_adapter_layers, merged, rescaled)"
        return None


class WeightsWatch:
    """The weights of ``model`` as they are now; :meth:`change` says whether they are other weights since.

    ``digest``: the :func:`~.namespace.loaded_weights_digest` of the weights now (computed here if not
    given). A check costs one pass over the modules and :data:`SAMPLES_PER_PARAMETER` integer reads
    per weight tensor, whatever their size: about 1 ms for the 291 parameters of a 32-layer Llama
    (a 7B's count) on a 2-core VM; nothing is hashed while nothing changes. The walk over the
    modules, not a list kept, is what sees a module replaced (an adapter wrapped around a projection
    adds parameters). A change seen costs one digest (a read of every weight), and one per later
    change: a session whose weights moved is not refused for that alone. Holds a reference to every
    tensor it recorded (a replaced one stays in memory as long as the watch does). Not thread safe:
    its owner calls it under its request lock.
    """

    def __init__(self, model: torch.nn.Module, digest: str | None = None) -> None:
        self._model = model
        self._recorded = _Snapshot.of(model)
        self._digest = digest if digest is not None else loaded_weights_digest(model)
        # The weights last found to be other ones, and why: refused again, unhashed, until they change.
        self._foreign: tuple[_Snapshot, str] | None = None

    def change(self) -> str | None:
        """What makes the weights other ones than at construction (the first change found, in
        words), or None while they are the same (moved or rewritten with the same bytes included)."""
        change = self._recorded.change(self._model)
        if change is None:
            return None
        if self._foreign is not None and self._foreign[0].change(self._model) is None:
            return self._foreign[1]
        # Recorded before hashing: a write during the digest shows at the next check.
        now = _Snapshot.of(self._model)
        if loaded_weights_digest(self._model) == self._digest:
            self._recorded, self._foreign = now, None
            return None
        self._foreign = (now, change)
        return change
