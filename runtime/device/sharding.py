"""Tensor parallelism over a device mesh (XLA SPMD).

Every parameter and cache array declares *logical* axes; one rules table maps logical axes to
the mesh axes `("data", "model")`. A logical axis is sharded only when its size divides evenly
by the mesh axis: Gemma 3 270M's single KV head stays replicated on a tp=4 mesh (its 4 q heads
are split), and no dimension is ever split unevenly. The jitted step runs with these
`NamedSharding`s as in/out shardings; XLA inserts the collectives (all-reduce after `wo` and
`w_down`, gathers for the vocab-sharded embedding and logits).

    mesh = make_mesh(tensor_parallel=4)
    params = shard_params(params, mesh)               # or load straight into shards:
    place = shard_placer(mesh, jnp.float32)           #   loaders' per-tensor `place` hook
    shardings = param_shardings(abstract, mesh)       #   orbax restore targets

Any pytree leaf type is handled generically: a `QuantizedArray`'s values shard like the dense
weight and its scales (size 1 on the contracted axes) along the same non-contracted axes,
because an axis of size 1 never divides and stays replicated. Int8 KV pools (`QuantizedPages`)
likewise: values [Hkv, N, ps, Dh], scales [Hkv, N, ps] split on the KV-head axis.

Vision towers split by their own table (VISION_AXES: heads and MLP width, the rest whole):
`shard_params(vision_params, mesh, table=VISION_AXES)`.

Several hosts (one mesh over every process's devices): runtime/device/distributed.py.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P

from jaxinfer.runtime.device.tree_paths import path_names

MESH_AXES = ("data", "model")

# logical axis -> mesh axis (None = replicated). Applied only where the size divides evenly.
RULES: dict[str, str | None] = {
    "vocab": "model",
    "heads": "model",
    "kv_heads": "model",
    "mlp": "model",
    "expert": "model",  # expert parallelism: each device holds E / tp experts
    "embed": None,
    "head_dim": None,
    "pages": None,
    "page_slot": None,
}

# parameter leaf name -> logical axes of the dense weight (shapes as in runtime/device/model.py)
PARAM_AXES: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),  # [V, D]
    "lm_head": ("vocab", "embed"),  # [V, D]
    "wq": ("embed", "heads", "head_dim"),  # [D, Hq, Dh]
    "wk": ("embed", "kv_heads", "head_dim"),  # [D, Hkv, Dh]
    "wv": ("embed", "kv_heads", "head_dim"),
    "wqkv": ("embed", "kv_heads", None, "head_dim"),  # [D, Hkv, G + 2, Dh]
    "wo": ("heads", "head_dim", "embed"),  # [Hq, Dh, D]
    "w_gate": ("embed", "mlp"),  # [D, F]
    "w_up": ("embed", "mlp"),
    "w_gate_up": ("embed", "mlp", None),  # [D, F, 2]
    "w_down": ("mlp", "embed"),  # [F, D]
    "router": ("embed", None),  # [D, E] (replicated: every device routes every token)
    "we_gate": ("expert", "embed", "mlp"),  # [E, D, Fe]: split by expert first
    "we_up": ("expert", "embed", "mlp"),
    "we_down": ("expert", "mlp", "embed"),  # [E, Fe, D]
    "shared_gate": ("embed",),  # [D]
    "bq": ("heads", "head_dim"),
    "bk": ("kv_heads", "head_dim"),
    "bv": ("kv_heads", "head_dim"),
    "sinks": ("heads",),  # [Hq]
    "bo": ("embed",),  # [D]
    "router_b": (None,),  # [E]
    "we_gate_b": ("expert", "mlp"),  # [E, Fe]
    "we_up_b": ("expert", "mlp"),
    "we_down_b": ("expert", "embed"),  # [E, D]
    "router_choice_b": (None,),  # [E]
    # latent attention (runtime/device/mla.py): heads split, the latent whole
    "wq_a": ("embed", None),  # [D, Cq]
    "q_a_norm": (None,),
    "wq_b": (None, "heads", "head_dim"),  # [Cq, H, N + R]
    "wkv_a": ("embed", None),  # [D, C + R]
    "kv_a_norm": (None,),
    "w_uk": ("heads", None, None),  # [H, N, C]
    "w_uv": ("heads", None, None),  # [H, C, V]
    # Gemma 4: the per-layer inputs' table split by vocabulary like the embedding; the rest small
    "embed_per_layer": ("vocab", None),  # [Vp, L * P]
    "ple_model_proj": ("embed", None),  # [D, L * P]
    "ple_gate": ("embed", None),  # [D, P]
    "ple_proj": (None, "embed"),  # [P, D]
    "router_scale": ("embed",),  # [D]
    "expert_scale": (None,),  # [E]
    "q_norm": ("head_dim",),
    "k_norm": ("head_dim",),
    "attn_norm": ("embed",),
    "mlp_norm": ("embed",),
    "post_attn_norm": ("embed",),
    "post_mlp_norm": ("embed",),
    "final_norm": ("embed",),
}

# vision towers (runtime/device/vision.py, qwen3_vl_vision.py): their layers split like the
# language model's (heads across devices, the MLP's width; an all-reduce after wo and fc2); the
# patch embedding, positions, norms and Gemma 3's projector stay whole. Qwen3-VL's mergers are
# MLPs too (fc1 [m*m*D, m*m*D] split by output, fc2 [m*m*D, D_out] by input).
VISION_AXES: dict[str, tuple[str | None, ...]] = {
    "wq": ("embed", "heads", "head_dim"),  # [Dv, H, Dh]
    "wk": ("embed", "heads", "head_dim"),
    "wv": ("embed", "heads", "head_dim"),
    "bq": ("heads", "head_dim"),  # [H, Dh]
    "bk": ("heads", "head_dim"),
    "bv": ("heads", "head_dim"),
    "wqkv": ("embed", None, "heads", "head_dim"),  # Qwen3-VL [D, 3, H, Dh]
    "bqkv": (None, "heads", "head_dim"),  # [3, H, Dh]
    "wo": ("heads", "head_dim", "embed"),  # [H, Dh, Dv]
    "fc1": ("embed", "mlp"),  # [Dv, F]
    "fc1_b": ("mlp",),
    "fc2": ("mlp", "embed"),  # [F, Dv]
}

# LoRA slots (runtime/device/lora.py): per target, the (input, output) axes of its flattened projection;
# a [L, Din, R] splits its input like the base weight, b [L, R, Dout] its output (the rank and
# slot axes stay whole), so x A and (x A) B follow the base matmul's layout
LORA_AXES: dict[str, tuple[str, str]] = {
    "q": ("embed", "heads"), "k": ("embed", "kv_heads"), "v": ("embed", "kv_heads"),
    "o": ("heads", "embed"), "gate": ("embed", "mlp"), "up": ("embed", "mlp"),
    "down": ("mlp", "embed"),
}

# KV page pool [Hkv, N, ps, Dh]; int8 pools' scales [Hkv, N, ps] take the leading axes
CACHE_AXES: tuple[str, ...] = ("kv_heads", "pages", "page_slot", "head_dim")


# ------------------------------------------------------------------------------------ mesh


def make_mesh(tensor_parallel: int = 1, data_parallel: int = 1, devices=None) -> Mesh:
    """A ("data", "model") mesh over the first dp * tp devices (all processes' devices in a
    multi-host job). On TPU the device order follows the physical topology."""
    devices = list(jax.devices() if devices is None else devices)
    n = tensor_parallel * data_parallel
    if tensor_parallel < 1 or data_parallel < 1:
        raise ValueError(f"tensor_parallel and data_parallel must be >= 1, got "
                         f"{tensor_parallel}, {data_parallel}")
    if n > len(devices):
        raise ValueError(
            f"tensor_parallel={tensor_parallel} x data_parallel={data_parallel} needs {n} devices, "
            f"{len(devices)} available ({devices[0].platform}); on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n}"
        )
    if jax.process_count() > 1 and n != len(devices):
        raise ValueError(f"multi-host: tensor_parallel x data_parallel ({n}) must cover all "
                         f"{len(devices)} devices of the {jax.process_count()} processes")
    shape = (data_parallel, tensor_parallel)
    try:
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, devices[:n])
    except (ValueError, NotImplementedError, AssertionError):  # a topology it cannot tile
        grid = np.asarray(devices[:n], dtype=object).reshape(shape)
    return Mesh(grid, MESH_AXES)


def mesh_spec(axes: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh,
              rules: dict[str, str | None] = RULES) -> P:
    """PartitionSpec for an array of `shape` with logical `axes`: each axis maps through
    `rules` when its size divides the mesh axis (and the mesh axis is not used yet), else it is
    replicated. A rank mismatch (an unknown leaf layout) is fully replicated."""
    if len(axes) != len(shape):
        return P()
    used, out = set(), []
    for name, size in zip(axes, shape):
        m = rules.get(name)
        if m is not None and m not in used and m in mesh.shape and size % mesh.shape[m] == 0:
            used.add(m)
            out.append(m)
        else:
            out.append(None)
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def param_axes(path: str | list[str], table: dict = PARAM_AXES) -> tuple[str, ...] | None:
    """Logical axes of the parameter at `path` ("layers.3.wq", "layers.3.wq.values", ...): the
    last path component that names a weight in `table` decides (wrappers such as `.values` /
    `.scales` inherit the weight's axes)."""
    names = path.split(".") if isinstance(path, str) else path
    if len(names) >= 3 and names[0] == "lora" and names[-1] in LORA_AXES:  # lora.i.{a,b}.target
        din, dout = LORA_AXES[names[-1]]
        return (None, din, None) if names[-2] == "a" else (None, None, dout)
    for n in reversed(names):
        if n in table:
            return table[n]
    return None


def param_shardings(params, mesh: Mesh, rules: dict[str, str | None] = RULES,
                    table: dict = PARAM_AXES):
    """A pytree of NamedSharding matching `params` (arrays or ShapeDtypeStructs, any leaf
    wrapper types such as QuantizedArray); `table`: leaf name -> logical axes (VISION_AXES for
    a vision tower)."""
    def one(kp, leaf):
        axes = param_axes(path_names(kp), table)
        spec = P() if axes is None else mesh_spec(axes, tuple(leaf.shape), mesh, rules)
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(one, params)


def cache_shardings(cache, mesh: Mesh, rules: dict[str, str | None] = RULES):
    """A pytree of NamedSharding matching a KVCache (dense or int8 pools)."""
    def one(leaf):
        axes = CACHE_AXES[: len(leaf.shape)]
        return NamedSharding(mesh, mesh_spec(axes, tuple(leaf.shape), mesh, rules))

    return jax.tree.map(one, cache)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


# ------------------------------------------------------------------------------- placement


def put(x, sharding: NamedSharding, dtype=None) -> jax.Array:
    """Place one array onto `sharding`. A host (numpy) array is sliced on the host and each
    addressable device receives only its slice (works multi-host: every process passes the same
    global array and fills its own devices). A device array already laid out so is returned."""
    if isinstance(x, jax.Array):
        if dtype is not None and x.dtype != dtype:
            x = x.astype(dtype)
        if x.sharding == sharding or (x.sharding.is_equivalent_to(sharding, x.ndim)):
            return x
        if x.is_fully_addressable:
            x = np.asarray(x)  # host copy (free on CPU); then slice per device below
        else:
            return jax.device_put(x, sharding)
    x = np.asarray(x)
    if dtype is not None and x.dtype != dtype:
        x = x.astype(dtype)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def shard_params(params, mesh: Mesh, rules: dict[str, str | None] = RULES,
                 table: dict = PARAM_AXES):
    """Place a Params tree (any leaf wrappers) onto `mesh` by the rules; `table` as in
    param_shardings."""
    return jax.tree.map(lambda a, s: put(a, s), params,
                        param_shardings(params, mesh, rules, table))


def shard_placer(mesh: Mesh, dtype, inner: Callable | None = None) -> Callable:
    """A loaders' `place(path, f32_array)` hook: `inner` (e.g. the quantizing placer) makes
    the leaf, then each of its arrays goes straight to its shards; without `inner` the tensor
    is cast to `dtype`. Checkpoints thus stream tensor by tensor into their device slices."""
    dtype = jnp.dtype(dtype)

    def place(path: str, arr):
        leaf = inner(path, arr) if inner is not None else arr
        names = path.split(".")

        def one(kp, a):
            axes = param_axes(names + path_names(kp))
            spec = P() if axes is None else mesh_spec(axes, tuple(a.shape), mesh)
            cast = dtype if inner is None and not hasattr(leaf, "dequantize") else None
            return put(a, NamedSharding(mesh, spec), cast)

        return jax.tree_util.tree_map_with_path(one, leaf)

    finish = getattr(inner, "finish", None)
    if finish is not None:  # int8 smoothing re-quantizes some weights: lay them out again
        place.finish = lambda cfg, params, tok: shard_params(finish(cfg, params, tok), mesh)
    return place


def init_sharded_cache(make: Callable, mesh: Mesh):
    """Allocate a cache (`make()` returns a KVCache) directly in its shards: no device ever
    holds the whole pool."""
    abstract = jax.eval_shape(make)
    return jax.jit(make, out_shardings=cache_shardings(abstract, mesh))()


def bytes_per_device(tree) -> int:
    """Bytes of `tree`'s arrays held by one device (its first addressable shard of each)."""
    return int(sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(tree)))


# ------------------------------------------------------------------ attention kernels under TP


def shard_kv_heads(attention: Callable, mesh: Mesh | AbstractMesh) -> Callable:
    """Wrap a ragged paged-attention call `attention(q, k_pages, v_pages, kv_lens, page_indices,
    cu_q_lens, num_seqs, **kw)` in a `shard_map` over the mesh's "model" axis (tp devices), so
    that each device runs the kernel on its own heads. Pallas (Mosaic / Triton) kernels need
    this: XLA SPMD cannot partition their custom calls. GQA: q head h reads kv head h // G.
      KV heads divide tp:  q [T, Hq/tp, Dh], pages [Hkv/tp, N, ps, Dh] (groups stay whole)
      one KV head, q heads divide tp: q [T, Hq/tp, Dh], the (replicated) pool whole
      otherwise:           every operand whole on every device (the kernel runs replicated)
    int8 pages' `k_scale` / `v_scale` [Hkv, N, ps] split like the pages, `sinks` [Hq] like q's
    heads; the metadata is
    replicated; the output [T, Hq, Dh] comes back split like q. No mesh, or no "model" axis
    over several devices: the call as it is."""
    tp = 1 if mesh.empty or "model" not in mesh.axis_names else mesh.shape["model"]

    def wrapped(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                k_scale=None, v_scale=None, sinks=None, **kw):
        meta = (kv_lens, page_indices, cu_q_lens, num_seqs)
        scales = () if k_scale is None else (k_scale, v_scale)
        sk = () if sinks is None else (sinks,)
        if tp == 1:
            return attention(q, k_pages, v_pages, *meta, **kw,
                             **dict(zip(("k_scale", "v_scale"), scales)),
                             **dict(zip(("sinks",), sk)))
        hkv, hq = k_pages.shape[0], q.shape[1]
        heads, split, whole = P(None, "model"), P("model"), P()
        if hkv % tp == 0:
            q_spec, pool = heads, split
        elif hkv == 1 and hq % tp == 0:
            q_spec, pool = heads, whole
        else:
            q_spec, pool = whole, whole

        def local(q, k, v, *rest):  # rest: the metadata, the scales, the sinks
            sc = dict(zip(("k_scale", "v_scale"), rest[4:4 + len(scales)]))
            return attention(q, k, v, *rest[:4], **kw, **sc,
                             **dict(zip(("sinks",), rest[4 + len(scales):])))

        sk_spec = split if q_spec == heads else whole  # sinks [Hq] split like q's heads
        fn = jax.shard_map(local, mesh=mesh, out_specs=q_spec, check_vma=False,
                           in_specs=(q_spec, pool, pool) + (whole,) * 4 + (pool,) * len(scales)
                           + (sk_spec,) * len(sk))
        return fn(q, k_pages, v_pages, *meta, *scales, *sk)

    return wrapped
