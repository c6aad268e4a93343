"""runtime/sampling.row_argmax against numpy's argmax (first index of the max; NaN counts as the
max): ties, NaN, rows of -inf, vocabularies that are not a multiple of its 128-entry runs,
small vocabularies and extra leading axes."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxinfer.runtime.device.sampling import row_argmax


def _numpy_argmax(x: np.ndarray) -> np.ndarray:
    # numpy's argmax returns the first NaN where a row has one, as jnp.argmax does
    return np.argmax(x, axis=-1).astype(np.int32)


@pytest.mark.parametrize("shape", [(16, 262144), (1, 1000), (5, 300), (3, 4, 1280), (2, 100)])
def test_equals_numpy(shape):
    rng = np.random.default_rng(sum(shape))
    # small integers: many ties, so "the first index" is exercised, not just "an index"
    x = rng.integers(-50, 50, size=shape).astype(np.float32)
    got = np.asarray(jax.jit(row_argmax)(x))
    np.testing.assert_array_equal(got, _numpy_argmax(x))
    assert got.dtype == np.int32 and got.shape == shape[:-1]


def test_nan_and_minus_inf_rows():
    x = np.random.default_rng(0).standard_normal((6, 1000)).astype(np.float32)
    x[0, :] = -np.inf  # every id masked: index 0, as jnp.argmax gives
    x[1, 700] = np.nan  # NaN beats every number
    x[2, [5, 900]] = np.nan  # the first NaN
    x[3, 999] = 1e30  # the last entry, in the padded last run
    x[4, 130] = x[4, 3] = 1e30  # a tie across runs: the earlier one
    got = np.asarray(row_argmax(x))
    np.testing.assert_array_equal(got, _numpy_argmax(x))
    np.testing.assert_array_equal(got[:5], [0, 700, 5, 999, 3])
