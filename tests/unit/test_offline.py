"""The offline API's argument handling (the engine side is in tests/integration/test_engine.py)."""

from __future__ import annotations

from enum import IntEnum

import numpy as np
import pytest
import torch

from hotwire_core.offline import _as_vector, _layer_list, check_steering


@pytest.mark.parametrize(
    "layers",
    [[3, 1], (3, 1), np.array([3, 1]), torch.tensor([3, 1]), [np.int64(3), np.int32(1)], [torch.tensor(3), 1],
     [IntEnum("Layer", {"A": 3}).A, 1]],
)
def test_layers_become_plain_ints(layers):
    out = _layer_list(layers)
    assert out == [3, 1] and all(type(v) is int for v in out)


@pytest.mark.parametrize(
    "layers", [[1.0, 3.0], [True, 2], np.array([True]), torch.tensor([1.5]), "13", 3, {3, 1}, {3: 0}]
)
def test_layers_that_are_not_integers_are_refused(layers):
    with pytest.raises(TypeError, match="layers must be"):
        _layer_list(layers)


def test_no_layers_stays_none():
    assert _layer_list(None) is None


def test_check_steering_needs_a_spec():
    with pytest.raises(ValueError, match="steer"):
        check_steering(object(), {"other": 1})


@pytest.mark.parametrize(
    "array",
    [
        np.arange(4, dtype=np.float64),
        np.arange(4, dtype=np.float32)[::-1][::-1],
        np.arange(4, dtype=">f4"),  # big-endian
        np.arange(4, dtype=np.longdouble),
        np.arange(4, dtype=np.uint32),
        np.arange(8, dtype=np.float16)[::2],
    ],
)
def test_vectors_may_be_numpy_arrays(array):
    out = _as_vector(array)
    assert isinstance(out, torch.Tensor) and out.tolist() == array.astype(np.float64).tolist()


def test_a_reversed_numpy_view_keeps_its_order():
    assert _as_vector(np.arange(4, dtype=np.float32)[::-1]).tolist() == [3.0, 2.0, 1.0, 0.0]


@pytest.mark.parametrize(
    "vector, error, words",
    [
        (torch.tensor(1.0), ValueError, "got a scalar"),
        (torch.ones(4, dtype=torch.complex64), TypeError, "real numbers"),
        (torch.ones(4, dtype=torch.bool), TypeError, "real numbers"),
        (torch.tensor([1.0, 1e39], dtype=torch.float64), ValueError, "float32's range"),
        ([1.0, 2.0], TypeError, "torch tensor or numpy array"),
        (np.array([object(), object()]), TypeError, "real numbers"),
        (np.array(["1", "2"]), TypeError, "real numbers"),
        (np.array([True]), TypeError, "real numbers"),
    ],
)
def test_vectors_that_cannot_be_sent_say_why(vector, error, words):
    with pytest.raises(error, match=words):
        _as_vector(vector)
