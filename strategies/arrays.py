"""Flower's ``Array`` to and from NumPy without writing or parsing the ``.npy`` header of every message.

``flwr.app.Array.numpy()`` runs ``numpy.load`` on the array's bytes, which parses the ``.npy``
header with ``ast.literal_eval`` and copies the values. A round of a thousand sites reads about
twenty arrays a reply, several times over (checks, the bounded mean, the aggregate), and every
site reads the same global model: the parsing was a tenth of such a round. :func:`values` parses
each distinct header once (the same shapes and dtypes come back every round) and returns a
read-only view of the values in the array's own bytes. :func:`array_record` is the other way:
``ArrayRecord(state_dict)``'s bytes, with each distinct header written once.
"""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord

__all__ = ["array_record", "values"]

_MAGIC = b"\x93NUMPY"
_READERS = {(1, 0): "read_array_header_1_0", (2, 0): "read_array_header_2_0"}


def values(array: Array) -> np.ndarray:
    """``array.numpy()``'s values as a read-only view of the array's bytes; ``array.numpy()`` itself for anything
    but a plain ``.npy`` array (and for bytes that do not hold what their header says, so its errors are the same)."""
    if array.stype != "numpy.ndarray":
        return array.numpy()
    data = memoryview(array.data)
    end = _header_end(data)
    header = _header(bytes(data[:end])) if end else None
    if header is None:
        return array.numpy()
    shape, fortran, dtype = header
    try:
        flat = np.frombuffer(data, dtype=dtype, count=math.prod(shape), offset=end)
    except ValueError:
        return array.numpy()
    return flat.reshape(shape, order="F" if fortran else "C")


def _header_end(data: memoryview) -> int:
    """Where a version 1 or 2 ``.npy`` header ends (0: not such a file)."""
    if len(data) < 10 or bytes(data[:6]) != _MAGIC or (data[6], data[7]) not in _READERS:
        return 0
    size = 2 if data[6] == 1 else 4
    if len(data) < 8 + size:
        return 0
    return 8 + size + int.from_bytes(data[8:8 + size], "little")


@functools.lru_cache(maxsize=1024)
def _header(prefix: bytes) -> tuple[tuple[int, ...], bool, np.dtype] | None:
    """(shape, Fortran order, dtype) of a ``.npy`` header; None for one NumPy refuses or an object dtype."""
    stream = io.BytesIO(prefix)
    try:
        reader = _READERS[np.lib.format.read_magic(stream)]
        shape, fortran, dtype = getattr(np.lib.format, reader)(stream)
    except (ValueError, KeyError):
        return None
    if dtype.hasobject or stream.tell() != len(prefix):
        return None
    return tuple(shape), bool(fortran), dtype


def array_record(state_dict: Mapping[str, Any]) -> ArrayRecord:
    """``ArrayRecord(state_dict)`` for a dict of CPU tensors, byte for byte: each ``.npy`` header is
    written once per (dtype, shape) (:func:`_npy_header`) and the values appended; anything but a
    C-contiguous array of a plain dtype takes Flower's own ``Array``."""
    record = ArrayRecord()
    for name, tensor in state_dict.items():
        array = tensor.detach().cpu().numpy()
        plain = array.flags.c_contiguous and not array.dtype.hasobject
        header = _npy_header(array.dtype.str, array.shape) if plain else None
        record[name] = Array(array) if header is None else Array(
            dtype=str(array.dtype), shape=tuple(array.shape), stype="numpy.ndarray", data=header + array.tobytes())
    return record


@functools.lru_cache(maxsize=1024)
def _npy_header(dtype: str, shape: tuple[int, ...]) -> bytes | None:
    """The version 1.0 ``.npy`` header ``numpy.save`` writes for a C-ordered array of ``dtype`` and ``shape``
    (None where it needs a later version)."""
    stream = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(stream, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                                      "fortran_order": False, "shape": shape})
    except ValueError:
        return None
    return stream.getvalue()
