"""Weights into and out of a running engine (LLM.update_weights / get_weights, Engine.sleep).

The model's own parameter layout, what `get_weights()` returns and `update_weights()` takes: a
`runtime.device.model.Params` as a checkpoint loads it. Separate `wq` [D, Hq, Dh], `wk` / `wv`
[D, Hkv, Dh], `wo` [Hq, Dh, D], `w_gate` / `w_up` [D, F], `w_down` [F, D] per layer (the shapes
written beside LayerParams' fields), `embed` [V, D], `lm_head` [V, D] or None when tied, norms as
their effective multipliers (Gemma's 1 + w folded in), no LoRA stack. `model.forward` and
`runtime.device.scoring.sequence_logprobs` take it as it is: it is what a trainer differentiates.

    engine_form(loaded, config, mesh)  the form the engine runs (build.prepare's step): Q/K/V and
                                       gate/up fused, tensor-parallel shards, CPU output-major
                                       pieces, committed to their devices
    loaded_form(params)                its inverse (no LoRA stack)
    rebuild(weights, engine)           a new version, in the engine's form, checked against the
                                       version it replaces; WeightError naming the tensor

No step program is recompiled by an update: `rebuild` refuses anything whose structure, shapes,
dtypes or placement differ from the current weights'.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.runtime.device import cpu_kernels
from jaxinfer.runtime.device.cpu_matmul import PackedWeight
from jaxinfer.runtime.device.quantization import QuantizedArray
from jaxinfer.runtime.device.tree_paths import path_str
from jaxinfer.runtime.device.weight_layout import OutputMajor


class WeightError(ValueError):
    """Weights the engine cannot take in place (missing, unexpected or mis-shaped tensors, a
    format it cannot rebuild); the message names the tensor. The serving version is untouched."""


def _is_leaf(x) -> bool:
    return isinstance(x, (QuantizedArray, OutputMajor, PackedWeight))


def engine_form(params, config, mesh=None, consume: bool = False):
    """Loaded-layout params (with the engine's LoRA stack, if any) -> the form the engine runs
    under `config`. `consume`: `params` are the caller's to give up (a fresh load): weights
    relaid out are deleted as they go, so the model is never held twice."""
    from jaxinfer.runtime.device.fused_projections import fuse_projections
    from jaxinfer.runtime.device.weight_layout import (cpu_pieces, output_major_layers,
                                                       use_output_major)

    # batch-invariant engines run the model's own layout by default: a trainer's forward on
    # get_weights() then multiplies the same way, bit for bit (runtime/device/scoring.py)
    plain = config.batch_invariant and config.weight_layout == "auto"
    output_major = (mesh is None and not plain
                    and use_output_major(config.weight_layout, jax.default_backend()))
    fuse = config.fuse_projections
    if fuse or (fuse is None and not output_major and not config.batch_invariant):
        # one QKV and one gate/up weight (runtime/device/fused_projections.py)
        params = fuse_projections(params, 1 if mesh is None else mesh.shape["model"])
    if mesh is not None:
        from jaxinfer.runtime.device.sharding import shard_params

        # (the Pallas kernels run per device on their heads: runtime/device/attention.py)
        return shard_params(params, mesh)
    if output_major:
        # layer weights stored [out, in], a piece per core (runtime/device/weight_layout.py).
        # Not when split over host devices: the mixed workload measured 282 vs 288 tok/s there
        params = output_major_layers(params, cpu_pieces(), kernels=cpu_kernels.available(),
                                     consume=consume)
    # committed to the device, as the cache and every step's outputs are: a later version put
    # on the same device keeps the programs' signatures
    return jax.device_put(params, jax.devices()[0])


def _unfused(lp):
    """A LayerParams with wqkv / w_gate_up split back into wq, wk, wv / w_gate, w_up."""
    def cut(w, fn):
        if isinstance(w, QuantizedArray):  # scales / offsets keep the output axes after axis 0
            return w.replace(values=fn(w.values), scales=fn(w.scales),
                             offsets=None if w.offsets is None else fn(w.offsets))
        return fn(w)

    upd = {}
    if lp.wqkv is not None:  # [D, Hkv, G + 2, Dh]
        w = lp.wqkv
        g = w.shape[2] - 2
        upd.update(wqkv=None,
                   wq=cut(w, lambda a: a[:, :, :g].reshape(a.shape[0], -1, a.shape[3])),
                   wk=cut(w, lambda a: a[:, :, g]), wv=cut(w, lambda a: a[:, :, g + 1]))
    if lp.w_gate_up is not None:  # [D, F, 2]
        upd.update(w_gate_up=None, w_gate=cut(lp.w_gate_up, lambda a: a[..., 0]),
                   w_up=cut(lp.w_gate_up, lambda a: a[..., 1]))
    return lp.replace(**upd)


def loaded_form(params):
    """The engine's params -> the model's own layout (see the module doc), without LoRA."""
    params = jax.tree.map(lambda x: x.logical() if isinstance(x, (OutputMajor, PackedWeight))
                          else x, params, is_leaf=_is_leaf)
    return params.replace(layers=tuple(_unfused(lp) for lp in params.layers), lora=None)


def _leaves(tree) -> dict:
    """{"layers.3.wq": leaf} (a QuantizedArray is one leaf)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, QuantizedArray))
    return {path_str(kp): x for kp, x in flat}


def _dense(x):
    """What a trainer holds in place of a leaf: a QuantizedArray's dense shape (float)."""
    if isinstance(x, QuantizedArray):
        return jax.ShapeDtypeStruct(x.shape, jnp.dtype(x.dtype))
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def check_layout(new, want) -> None:
    """WeightError unless `new` has `want`'s tensors (names, shapes; float where float)."""
    got, exp = _leaves(new), _leaves(want)
    missing, extra = sorted(set(exp) - set(got)), sorted(set(got) - set(exp))
    if missing or extra:
        raise WeightError(f"the weights do not match the model's layout: missing "
                          f"{missing[:8]}{' ...' if len(missing) > 8 else ''}, unexpected "
                          f"{extra[:8]}{' ...' if len(extra) > 8 else ''}")
    for name, w in exp.items():
        g = got[name]
        if tuple(g.shape) != tuple(w.shape):
            raise WeightError(f"{name}: shape {tuple(g.shape)}, the model's is {tuple(w.shape)}")
        if isinstance(g, QuantizedArray) or isinstance(w, QuantizedArray):
            continue
        if jnp.issubdtype(g.dtype, jnp.floating) != jnp.issubdtype(w.dtype, jnp.floating):
            raise WeightError(f"{name}: dtype {g.dtype}, the model's is {w.dtype}")


def _finite(tree) -> None:
    """WeightError naming the first float tensor with a NaN or an infinity."""
    dense = {n: x for n, x in _leaves(tree).items()
             if not isinstance(x, QuantizedArray) and jnp.issubdtype(x.dtype, jnp.floating)}
    flags = np.asarray(_finite_flags(list(dense.values())))
    bad = [n for n, ok in zip(dense, flags) if not ok]
    if bad:
        raise WeightError(f"{bad[0]}: holds NaN or infinite values")


@jax.jit
def _finite_flags(leaves: list) -> jax.Array:  # one program per layout, one sync
    return jnp.stack([jnp.isfinite(x).all() for x in leaves])


def read_weights(weights, engine):
    """`weights` (a Params tree in the model's layout, or a checkpoint dir / GGUF file of this
    model) -> a Params tree in the model's layout."""
    from jaxinfer.runtime.device.model import Params

    if isinstance(weights, Params):
        return weights
    if isinstance(weights, (str, bytes)) or hasattr(weights, "__fspath__"):
        from jaxinfer.checkpoints.loader import load_model

        loaded = load_model(weights, dtype=engine.ecfg.dtype, tokenizer=False)  # weights only
        if _arch(loaded.cfg) != _arch(engine.cfg):
            raise WeightError(f"{weights}: a different model ({loaded.cfg.architecture}, "
                              f"{loaded.cfg.num_layers} layers, hidden size "
                              f"{loaded.cfg.hidden_size}) than the engine serves")
        return loaded.params
    raise WeightError(f"weights must be a Params tree (LLM.get_weights()'s layout) or a "
                      f"checkpoint path, got {type(weights).__name__}")


def _arch(cfg) -> tuple:
    return (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.vocab_size)


def layout(engine, current):
    """The model's own layout of `engine`'s weights `current` (ShapeDtypeStructs;
    QuantizedArray leaves hold theirs), worked out once per engine: every version has it."""
    if getattr(engine, "_weight_layout", None) is None:
        engine._weight_layout = jax.eval_shape(loaded_form, current)
    return engine._weight_layout


def rebuild(weights, engine, current, shardings=None):
    """A new version of `engine`'s params `current` (its device arrays, or their host copies
    and `shardings` while it sleeps) from `weights` (see read_weights): checked, cast to the
    current dtypes, quantized as the engine's are (int8 / fp8 / int4), put in the engine's form
    on its devices, with the engine's LoRA stack. WeightError (naming the tensor) for anything
    that would not run in the engine's compiled programs; the engine is untouched."""
    from jaxinfer.checkpoints.quantize import quantization_spec, quantize_params

    spec = quantization_spec(current)
    if spec is not None and spec["fmt"] in ("gguf", "mxfp4"):
        raise WeightError(f"this engine keeps a checkpoint's {spec['fmt']} blocks, which cannot "
                          "be rebuilt from new weights: serve it with quantization='dequantize'")
    new = read_weights(weights, engine)
    want = layout(engine, current)
    check_layout(new, jax.tree.map(_dense, want, is_leaf=lambda x: isinstance(x, QuantizedArray)))
    new = _cast(new, _leaves(want))
    if engine.mesh is None:  # committed to the engine's device (trainer arrays there stay put),
        new = jax.device_put(new, jax.devices()[0])  # so every version runs the same programs
    _finite(new)
    if spec is not None and any(isinstance(w, QuantizedArray) and not isinstance(x, QuantizedArray)
                                for x, w in zip(_leaves(new).values(), _leaves(want).values())):
        ecfg = engine.ecfg  # quantized as at load (int8 smoothing calibrates again)
        new = quantize_params(new, spec["fmt"], jnp.dtype(ecfg.dtype), mode=spec["mode"],
                              quantize_embeddings=ecfg.quantize_embeddings, cfg=engine.cfg,
                              tokenizer=engine.tokenizer, activation_aware=not ecfg.enable_lora)
    new = engine_form(new.replace(lora=current.lora), engine.ecfg, engine.mesh)
    same(new, current, shardings)
    return new


def _cast(tree, want: dict):
    """`tree`'s dense float leaves as the dtype of `want`'s leaf of the same name (a quantized
    one: the engine's compute dtype of it)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, QuantizedArray))

    def one(name, x):
        w = want[name]
        if isinstance(x, QuantizedArray):
            return x
        dtype = jnp.dtype(w.dtype)
        return jnp.asarray(x, dtype)

    return jax.tree_util.tree_unflatten(treedef, [one(path_str(kp), x) for kp, x in flat])


def same(new, current, shardings=None) -> None:
    """WeightError unless `new` would run in `current`'s programs unchanged (structure, shapes,
    dtypes, shardings: `current`'s own, or `shardings` for host copies)."""
    if shardings is None:
        shardings = jax.tree.map(lambda x: x.sharding, current)
    t1, t2 = jax.tree.structure(new), jax.tree.structure(current)
    a = [(x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(new)]
    b = [(x.shape, x.dtype, s) for x, s in zip(jax.tree.leaves(current),
                                              jax.tree.leaves(shardings))]
    if t1 != t2:
        raise WeightError("the new weights' structure differs from the engine's (a different "
                          "quantization or layout): they would need new step programs")
    names = [path_str(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(current)[0]]
    for name, x, y in zip(names, a, b):
        if x != y:
            raise WeightError(f"{name}: {x[0]} {x[1]} on {x[2]}, the engine's is {y[0]} {y[1]} "
                              f"on {y[2]}: it would need new step programs")


def device_bytes() -> int:
    """Bytes in use on the first device (memory_stats where the platform has them; else the
    live arrays' total, e.g. on CPU)."""
    stats = jax.devices()[0].memory_stats()
    if stats and "bytes_in_use" in stats:
        return int(stats["bytes_in_use"])
    return int(sum(x.nbytes for x in jax.live_arrays()))


def to_host(tree):
    """(host copies of `tree`'s arrays, their shardings) for `from_host`."""
    return jax.device_get(tree), jax.tree.map(lambda x: x.sharding, tree)


def from_host(host, shardings):
    return jax.tree.map(lambda x, s: jax.device_put(x, s), host, shardings)


def delete(tree) -> None:
    """Free `tree`'s device buffers now (its arrays are unusable after)."""
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and not x.is_deleted():
            x.delete()
