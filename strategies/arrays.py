"""NumPy views of Flower's ``Array`` without parsing the ``.npy`` header of every message.

``flwr.app.Array.numpy()`` runs ``numpy.load`` on the array's bytes, which parses the ``.npy``
header with ``ast.literal_eval`` and copies the values. A round of a thousand sites reads about
twenty arrays a reply, several times over (checks, the bounded mean, the aggregate), and every
site reads the same global model: the parsing was a tenth of such a round. :func:`values` parses
each distinct header once (the same shapes and dtypes come back every round) and returns a
read-only view of the values in the array's own bytes.
"""

from __future__ import annotations

import functools
import io
import math

import numpy as np
from flwr.app import Array

__all__ = ["values"]

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
