"""Whether a model's weights are still the ones its namespace names, checked at every request.

A namespace is fixed when a :class:`~.session.KVTierLM` is built; every block key derives from
it. Weights changed in place afterwards (an optimizer step between rollouts, PEFT's
``merge_and_unload()``, ``load_state_dict`` of another checkpoint) keep the same tensors, so
the old namespace would keep serving the old weights' K/V as the new model's. Hashing the
weights again (:func:`~.namespace.loaded_weights_digest`) reads every byte: a second for a
16 GB model, too much for each request. :class:`WeightsWatch` instead records, once, what
changes when a parameter does, and compares it in one pass over the parameter list:

* the parameter objects and their names: a parameter replaced (``module.weight = Parameter(...)``);
* each one's ``data_ptr``: its ``.data`` set to another tensor (PEFT's safe merge), a conversion;
* each one's version counter, which torch bumps at every in-place write through the parameter
  or a view of it (optimizer steps, the ``copy_`` of ``load_state_dict``, any op under
  ``no_grad``);
* a few values read at spread positions: ``.data`` hands out a tensor with a version counter
  of its own, so writes through it (PEFT's merge, ``weight.data += delta``; older optimizers)
  bump nothing. A dense update (a merged LoRA, an optimizer step) changes every value read; a
  write through ``.data`` that spares every one of them goes unseen.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

#: values read from each parameter at every check (one integer read each)
SAMPLES_PER_PARAMETER = 8

# Integer views of the parameters' bytes: compared as integers, a NaN weight equals itself.
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _Recorded(NamedTuple):
    name: str
    param: torch.nn.Parameter  #: held: its id and memory cannot be reused by another tensor meanwhile
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


def _record(name: str, param: torch.nn.Parameter) -> _Recorded:
    values = _integer_view(param)
    positions = _spread_positions(param.numel()) if values is not None else ()
    return _Recorded(name, param, param.data_ptr(), _version(param), values, positions, _read(values, positions))


class WeightsWatch:
    """The parameters of ``model`` as they are now; :meth:`change` says what has changed since.

    Costs one pass over ``model.named_parameters()`` and :data:`SAMPLES_PER_PARAMETER` integer
    reads per parameter, whatever their size: 0.8 ms for the 291 parameters of a 32-layer Llama
    (a 7B's count) on a 2-core VM; nothing is hashed. The walk over the modules, not a list kept,
    is what sees a module replaced (an adapter wrapped around a projection adds parameters).
    Holds a reference to every parameter it recorded (a replaced one stays in memory as long as
    the watch does). Not thread safe: its owner calls it under its request lock.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self._recorded = [_record(name, param) for name, param in model.named_parameters()]

    def change(self) -> str | None:
        """What changed in the weights since construction (the first change found, in words), or None."""
        now = list(self._model.named_parameters())
        if len(now) != len(self._recorded):
            return f"the model has {len(now)} parameters, {len(self._recorded)} when it was built"
        for (name, param), was in zip(now, self._recorded):
            if name != was.name or param is not was.param:
                return f"parameter {name!r} was replaced"
            if param.data_ptr() != was.data_ptr:
                return f"parameter {name!r} holds other memory (its .data was set, or it was converted)"
            if _version(param) != was.version:
                return f"parameter {name!r} was written in place"
            if _read(was.values, was.positions) != was.sample:
                return f"parameter {name!r} was written in place (through .data)"
        return None
