"""Weight formats and the one einsum every weight goes through.

Model code calls `einsum(spec, x, w)` for every weight; the weight's type decides how the product
is computed (dense here; quantized types add their own `einsum`). Model code never asks which
format a weight has.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def einsum(spec: str, x: jax.Array, w) -> jax.Array:
    """`x` activations (compute dtype), `w` a weight (dense array or a type with `.einsum`).
    Accumulates in f32 and returns x's dtype."""
    if hasattr(w, "einsum"):
        return w.einsum(spec, x)
    out = jnp.einsum(spec, x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


def take_rows(w, ids: jax.Array) -> jax.Array:
    """Rows `ids` of a [V, D] table (embedding lookup) in the table's compute dtype."""
    if hasattr(w, "take_rows"):
        return w.take_rows(ids)
    return jnp.take(w, ids, axis=0)
