"""strategies.arrays.values: Array.numpy()'s values, with each .npy header parsed once."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array

from strategies.arrays import array_record, values


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


def test_array_record_writes_the_bytes_of_flowers_array_record():
    import torch
    from flwr.app import ArrayRecord

    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1, bias=False))
    tensors = {**net.state_dict(), "scalar": torch.tensor(2.5, dtype=torch.float64), "empty": torch.zeros(0, 3),
               "flags": torch.tensor([True, False]), "transposed": torch.arange(6.0).reshape(2, 3).T}
    ours, theirs = array_record(tensors), ArrayRecord(tensors)
    assert list(ours) == list(theirs)
    for name in theirs:
        assert (ours[name].data, ours[name].dtype, tuple(ours[name].shape), ours[name].stype) == (
            theirs[name].data, theirs[name].dtype, tuple(theirs[name].shape), theirs[name].stype), name
    for _ in range(2):  # the cached headers give the same bytes for new values
        net[0].weight.data.normal_()
        assert array_record(net.state_dict())["0.weight"].data == ArrayRecord(net.state_dict())["0.weight"].data
