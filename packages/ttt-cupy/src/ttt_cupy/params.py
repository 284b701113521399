"""The kernels' one argument: ctypes structures mirroring ``csrc/params.cuh`` field by field
(pointers as addresses, 0 for an absent tensor), :class:`FwdParams`, :class:`BwdParams` and
:class:`DecodeParams`. The launcher packs one per pass and copies it per launch
(:meth:`Params.at`); ``tests/test_launch_arguments.py`` checks the layouts against the C++."""

from __future__ import annotations

import ctypes
import functools
import struct

import numpy as np

_PTR, _I64, _U64, _F32, _I32 = (ctypes.c_uint64, ctypes.c_int64, ctypes.c_uint64,
                                ctypes.c_float, ctypes.c_int32)   # (pointers: addresses)


def _fields(pointers: str, i64: str, f32: str, i32: str) -> list[tuple[str, type]]:
    """Pointers, then 8-byte scalars (``smem_bytes`` unsigned), then 4-byte ones: the C++
    order (no padding inside)."""
    return ([(n, _PTR) for n in pointers.split()]
            + [(n, _U64 if n == "smem_bytes" else _I64) for n in i64.split()]
            + [(n, _F32) for n in f32.split()] + [(n, _I32) for n in i32.split()])


class Params(ctypes.Structure):
    """A kernel argument struct, ``Params(**fields)`` with tensors (or None) for pointers; it
    keeps the tensors whose addresses it holds (:attr:`tensors`)."""

    def __init__(self, **fields):
        # (packed in one call: a fraction of the cost of ctypes' initialisation by field)
        tensors = self.__dict__["tensors"] = []
        names, packer = self._layout()
        pop = fields.pop
        values = [_value(pop(name, 0), tensors) for name in names]
        if fields:
            raise TypeError(f"{type(self).__name__}: no fields {sorted(fields)}")
        packer.pack_into(self, 0, *values)

    @classmethod
    def _layout(cls) -> tuple[tuple[str, ...], struct.Struct]:
        """The field names in order and a ``struct.Struct`` packing them (no padding)."""
        layout = cls.__dict__.get("_packed_layout")
        if layout is None:
            codes = {_PTR: "Q", _I64: "q", _F32: "f", _I32: "i"}
            layout = (tuple(name for name, _ in cls._fields_),
                      struct.Struct("=" + "".join(codes[kind] for _, kind in cls._fields_)))
            cls._packed_layout = layout
        return layout

    def at(self, **fields) -> Params:
        """A copy with ``fields`` changed (a launch's segment, sync buffer, mode, ...)."""
        copy = type(self).from_buffer_copy(self)
        tensors = copy.__dict__["tensors"] = list(self.tensors)
        for name, value in fields.items():
            if not hasattr(type(self), name):
                raise TypeError(f"{type(self).__name__}: no field {name!r}")
            setattr(copy, name, _value(value, tensors))
        return copy

    def pointers(self) -> dict[str, int]:
        """{field: address} of the pointer fields (the first ``_n_pointers``)."""
        return {name: getattr(self, name) for name, _ in self._fields_[:self._n_pointers]}

    def as_numpy(self) -> np.void:
        """The struct as a NumPy structured scalar (how CuPy passes a struct by value)."""
        return np.frombuffer(bytes(self), dtype=_dtype(type(self)))[0]


def _value(value, tensors: list):
    """A field's value: a tensor's address (the tensor kept in ``tensors``), 0 for None."""
    kind = type(value)
    if kind is int or kind is float:
        return value
    if value is None:
        return 0
    if hasattr(value, "data_ptr"):
        tensors.append(value)
        return value.data_ptr()
    return value


@functools.cache
def _dtype(cls: type) -> np.dtype:
    return np.dtype(cls)


_FWD = ("q k v eta lnw lnb h0 hb0 ht hbt ck ckb xbuf rbuf o ekey rlbuf cu_seqlens grp_offsets "
        "grp_seq sync")
_BWD = ("q k v dout eta lnw lnb ck ckb xbuf rbuf rlbuf dopbuf dgbuf dq dk dv deta dwp_local "
        "dbp_local dwp dbp dht dhbt dck dckb dh0 dhb0 dkey cu_seqlens grp_offsets grp_seq sync")
_DEC = "q k v eta lnw lnb ekey h0 hb0 ht hbt o cu_seqlens"


_CHUNKED = ("T_len g_lo g_hi n_chains smem_bytes", "scale eps", "H D G mode wait_spins")


class FwdParams(Params):
    _fields_ = _fields(_FWD, *_CHUNKED)
    _n_pointers = len(_FWD.split())


class BwdParams(Params):
    _fields_ = _fields(_BWD, *_CHUNKED)
    _n_pointers = len(_BWD.split())


class DecodeParams(Params):
    _fields_ = _fields(_DEC, "T_len smem_bytes", "scale eps", "H D rows")
    _n_pointers = len(_DEC.split())


STRUCTS = {"FwdParams": FwdParams, "BwdParams": BwdParams, "DecodeParams": DecodeParams}
"""The C++ name (``ttt::<name>``) of each structure."""
