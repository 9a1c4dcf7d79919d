"""strategies.arrays.values: Array.numpy()'s values, with each .npy header parsed once."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array

from strategies.arrays import values


@pytest.mark.parametrize("array", [np.arange(12, dtype=np.float32).reshape(3, 4), np.full((), 2.5),
                                   np.zeros((0, 3)), np.asfortranarray(np.arange(6.0).reshape(2, 3)),
                                   np.arange(5, dtype=">i4"), np.array([True, False])])
def test_the_values_are_array_numpys(array):
    wrapped = Array(array)
    view = values(wrapped)
    expected = wrapped.numpy()
    assert view.dtype == expected.dtype and view.shape == expected.shape and np.array_equal(view, expected)
    assert not view.flags.writeable  # a view of the message's bytes


def test_bytes_that_do_not_hold_what_the_header_says_fail_as_array_numpy_fails():
    good = Array(np.arange(10.0))
    truncated = Array(dtype=good.dtype, shape=good.shape, stype=good.stype, data=good.data[:-8])
    with pytest.raises(ValueError) as ours:
        values(truncated)
    with pytest.raises(ValueError) as theirs:
        truncated.numpy()
    assert str(ours.value) == str(theirs.value)
    garbage = Array(dtype=good.dtype, shape=good.shape, stype=good.stype, data=b"not an npy file")
    with pytest.raises(ValueError):
        values(garbage)
