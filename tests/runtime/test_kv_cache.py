"""Page writes: the right slots change, and a one-row write stays in place (no pool copy)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.runtime.device.kv_cache import write_pages


@pytest.mark.parametrize("rows", [1, 3])
def test_write_pages_sets_exactly_the_mapped_slots(rows):
    hkv, n, ps, dh = 2, 6, 4, 8
    pages = jnp.asarray(np.random.default_rng(0).standard_normal((hkv, n, ps, dh)), jnp.float32)
    new = jnp.asarray(np.random.default_rng(1).standard_normal((rows, hkv, dh)), jnp.float32)
    slots = np.array([9, 22, 5][:rows], np.int32)  # page*ps + offset, none on the null page 0
    out = np.asarray(write_pages(pages, new, jnp.asarray(slots)))
    want = np.asarray(pages).reshape(hkv, n * ps, dh).copy()
    want[:, slots] = np.asarray(new).transpose(1, 0, 2)
    got = out.reshape(hkv, n * ps, dh)
    np.testing.assert_array_equal(got[:, ps:], want[:, ps:])  # every real page
    if rows > 1:  # a one-row write may scribble on the null page, never elsewhere
        np.testing.assert_array_equal(got, want)


def test_one_row_write_does_not_copy_the_pool():
    """XLA:CPU lowers a one-index scatter to a dynamic-update-slice that copies its operand;
    the donated pool must be updated in place (a decode step of one sequence writes one row)."""
    pages = jnp.zeros((1, 512, 16, 64), jnp.float32)
    f = jax.jit(write_pages, donate_argnums=0)
    hlo = f.lower(pages, jnp.ones((1, 1, 64)), jnp.array([37], jnp.int32)).compile().as_text()
    pool = "f32[1,8192,64]"
    copies = [ln for ln in hlo.splitlines() if " copy(" in ln and pool in ln.split("=")[1][:40]]
    assert not copies, copies
