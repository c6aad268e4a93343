"""Dense layer weights stored output-axes-first, for XLA:CPU's matmuls.

XLA:CPU multiplies a few activation rows by a weight laid out [contracted, out] (wq [D, Hq, Dh],
w_gate [D, F]) much slower than by the same weight laid out [out, contracted] with the product
kept as [out, rows] and transposed after: 18 layers of [D, F] + [F, D] products at D 640,
F 2048 take 19.6 / 24.3 / 32.3 ms at 8 / 16 / 32 rows the first way and 13.5 / 16.6 / 23.2 ms
the second (1.1x at 1 row, ~1.05x at 256; `python -m jaxinfer.tools.bench_cpu` measures the
model's steps). The transposed product alone, without the barrier that keeps its [out, rows]
layout, is no faster: XLA then picks the slow layout again.

`OutputMajor` keeps such a weight in that physical order. Its `einsum` takes the logical spec
model code writes ("td,dhk->thk"), so model code never sees the layout; `shape` is the logical
shape. Only dense, unsharded weights take this form (`output_major_layers`, on CPU).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.runtime.device import cpu_matmul
from jaxinfer.runtime.device.quantization import QuantizedArray, parse_einsum

# The axes each layer weight's einsum in runtime/device/model.py contracts (the rest are its outputs).
CONTRACTED_AXES: dict[str, tuple[int, ...]] = {
    "wq": (0,), "wk": (0,), "wv": (0,),  # [D, H, Dh]: "td,dhk->thk"
    "wqkv": (0,), "w_gate_up": (0,),  # "td,dhgk->thgk", "td,dfc->tfc" (fused_projections.py)
    "wo": (0, 1),  # [Hq, Dh, D]: "thk,hkd->td"
    "w_gate": (0,), "w_up": (0,), "w_down": (0,),  # "td,df->tf", "tf,fd->td"
}


@struct.dataclass
class OutputMajor:
    # the weight with its axes in `order` (output axes first, contracted last), cut into
    # `len(pieces)` equal parts along stored axis `axis` (an output axis)
    pieces: tuple[jax.Array, ...]
    order: tuple[int, ...] = struct.field(pytree_node=False)  # logical axis at each stored axis
    axis: int = struct.field(pytree_node=False, default=0)

    @classmethod
    def of(cls, w: jax.Array, contracted: tuple[int, ...], pieces: int = 1) -> OutputMajor:
        order = tuple(i for i in range(w.ndim) if i not in contracted) + tuple(contracted)
        stored = jnp.transpose(w, order)
        n_out = w.ndim - len(contracted)
        axis = next((a for a in range(n_out) if stored.shape[a] % pieces == 0), None)
        if axis is None:
            axis, pieces = 0, 1
        return cls(pieces=tuple(jnp.split(stored, pieces, axis=axis)), order=order, axis=axis)

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (model code's) shape."""
        stored = list(self.pieces[0].shape)
        stored[self.axis] *= len(self.pieces)
        return tuple(stored[self.order.index(i)] for i in range(len(self.order)))

    @property
    def ndim(self) -> int:
        return len(self.order)

    @property
    def dtype(self):
        return self.pieces[0].dtype

    def logical(self) -> jax.Array:
        """The weight in model code's axis order."""
        inverse = [self.order.index(i) for i in range(len(self.order))]
        return jnp.transpose(jnp.concatenate(self.pieces, self.axis), inverse)

    def einsum(self, spec: str, x: jax.Array) -> jax.Array:
        """`jnp.einsum(spec, x, w)` with w's logical axes; returns x.dtype (f32 accumulation).
        Each piece is its own product, which XLA:CPU runs concurrently."""
        xs, ws, out = parse_einsum(spec, x.ndim, self.ndim)
        stored = "".join(ws[i] for i in self.order)
        first = "".join([c for c in stored if c in out] + [c for c in xs if c in out])
        ys = [jax.lax.optimization_barrier(  # keeps each [out, rows] product's layout
            jnp.einsum(f"{stored},{xs}->{first}", p.astype(x.dtype), x,
                       preferred_element_type=jnp.float32)) for p in self.pieces]
        y = ys[0] if len(ys) == 1 else jnp.concatenate(ys, first.index(stored[self.axis]))
        return jnp.transpose(y, [first.index(c) for c in out]).astype(x.dtype)


def use_output_major(layout: str, platform: str) -> bool:
    """EngineConfig.weight_layout: "auto" stores layer weights output-major on CPU only (on
    TPU/GPU XLA picks the layout of a parameter's dot itself)."""
    return layout == "output_major" or (layout == "auto" and platform == "cpu")


def cpu_pieces() -> int:
    """Pieces each CPU layer weight is cut into: XLA:CPU runs a single-row product on one core,
    and two independent halves on two (18 layers of [D, F] + [F, D] at D 640, F 2048, one row:
    10.9 ms whole, 7.1 ms in halves, 13.1 ms in quarters on 2 cores)."""
    return 2 if (os.cpu_count() or 1) >= 2 else 1


def output_major_layers(params, pieces: int = 1, kernels: bool = False, consume: bool = False):
    """Params with each dense float layer weight in CONTRACTED_AXES as an `OutputMajor` (same
    values, stored transposed, in `pieces` parts) and, with `kernels`, each quantized matmul
    weight the CPU kernels take (layers', embed, lm_head) as a `PackedWeight`
    (runtime/device/cpu_matmul.py); other leaves (norms, what the kernels cannot take) as they
    are. For an unsharded model on CPU. `consume`: the weights replaced are deleted as their new
    form is ready (a fresh load: the process never holds the model twice)."""
    def dense(lp) -> dict:
        return {f: w for f in CONTRACTED_AXES if isinstance(w := getattr(lp, f), jax.Array)
                and jnp.issubdtype(w.dtype, jnp.floating)}

    def packed(obj, axes: dict) -> dict:
        out = {}
        for f, contracted in axes.items():
            w = getattr(obj, f)
            if kernels and isinstance(w, QuantizedArray) \
                    and (p := cpu_matmul.pack(w, contracted)) is not None:
                out[f] = p
        return out

    def replace(obj, new: dict):
        if consume:
            jax.block_until_ready(new)
            for f in new:
                for a in jax.tree.leaves(getattr(obj, f)):
                    a.delete()
        return obj.replace(**new)

    layers = tuple(replace(lp, {**_output_major(dense(lp), pieces), **packed(lp, CONTRACTED_AXES)})
                   for lp in params.layers)
    return replace(params.replace(layers=layers), packed(params, {"embed": (1,), "lm_head": (1,)}))


@functools.partial(jax.jit, static_argnames=("pieces",))
def _output_major(weights: dict, pieces: int) -> dict:
    """One layer's dense weights -> OutputMajor: one program for every layer of the same shapes
    (and every later version of them: runtime/weights.py), not an eager transpose per weight."""
    return {f: OutputMajor.of(w, CONTRACTED_AXES[f], pieces) for f, w in weights.items()}
