"""4-bit HF checkpoints, read from config.json's `quantization_config` with no extra flag: AWQ
(GEMM packing), GPTQ (v1 and v2 zero points, act-order `g_idx`) and compressed-tensors
`pack-quantized` (W4A16), the formats vLLM loads.

Each format's linear layer is a few tensors (packed int32 values, f16/bf16 scales, zero points,
...); `group_linears` collects them as the safetensors stream passes and yields one
`Int4Linear` per layer: unsigned values q [out, in] in 0..15 and per-group scales / offsets
[out, in / g], w = q * scale + offset (offset = -zero * scale). Its `layout` makes the runtime's
int4 QuantizedArray in the param's layout (runtime/device/quantization.py), or None when the groups do
not fit that layout (act-order groups, or a group wider than o_proj's head_dim): the loader then
takes `dense()`, the exact f32 weight.

Bit layouts (written from each format's documentation and reference packer):
  AWQ   (GEMM; "exllama" / "ipex" checkpoints hold the same tensors) qweight int32 [in, out/8],
        qzeros int32 [in/g, out/8], scales [in/g, out]; each int32 holds 8 consecutive output
        columns, column j in nibble AWQ_NIBBLE[j]; w[i, o] = (q - z) * s.
  GPTQ  qweight int32 [in/8, out] (8 consecutive input rows per int32, row 8k + j in nibble j),
        qzeros int32 [groups, out/8] (columns, nibble j), scales [groups, out], g_idx [in];
        w[i, o] = (q[i, o] - z[g_idx[i], o]) * s[g_idx[i], o], where the v1 format stores
        z - 1 (`checkpoint_format` "gptq", the default) and v2 stores z.
  compressed-tensors  weight_packed int32 [out, ceil(in/8)] (inputs, nibble j), values
        stored + 8 (signed -8..7 as 0..15); weight_scale [out, in/g] ([out, 1] per channel);
        asymmetric: weight_zero_point packed the same way along rows, int32 [ceil(out/8), in/g]
        (older files: int8 [out, in/g], signed, not packed); weight_g_idx [in] with group
        act-order; w = (q - 8 - zp) * s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from jaxinfer.checkpoints.errors import CheckpointError
from jaxinfer.runtime.device.quantization import QuantizedArray, pack_nibbles

AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)  # AWQ: output column j of 8 sits in nibble AWQ_NIBBLE[j]


@dataclass(frozen=True)
class Scheme:
    """A checkpoint's 4-bit format, from its quantization_config."""

    method: str  # "awq" | "gptq" | "compressed-tensors"
    group_size: int  # -1: one group over the whole input (checked against the scales' shape)
    zero_point: bool  # asymmetric (compressed-tensors); AWQ and GPTQ always store zeros
    gptq_v1: bool = False  # GPTQ zeros stored minus one
    actorder: bool = False  # a g_idx per linear (GPTQ desc_act, compressed-tensors "group")

    @property
    def required(self) -> tuple[str, ...]:
        """The tensor suffixes every quantized linear has."""
        if self.method == "awq":
            return ("qweight", "qzeros", "scales")
        if self.method == "gptq":  # g_idx: used when it comes first (as sorted names do)
            return ("qweight", "qzeros", "scales") + (("g_idx",) if self.actorder else ())
        return ("weight_packed", "weight_scale", "weight_shape") + (
            ("weight_zero_point",) if self.zero_point else ()) + (
            ("weight_g_idx",) if self.actorder else ())


def scheme_of(hf: dict, source: str) -> Scheme | None:
    """The 4-bit scheme of an HF config dict, None for an unquantized checkpoint; a clear
    CheckpointError for a quantization this runtime cannot read."""
    qc = hf.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise CheckpointError(f"{source}: quantization_config must be an object")
    method = qc.get("quant_method")
    if method == "awq":
        _bits(qc.get("bits", qc.get("w_bit")), source)
        version = str(qc.get("version", "gemm")).lower()
        if version not in ("gemm", "exllama", "ipex"):
            raise CheckpointError(f"{source}: AWQ version {version!r} is not supported (GEMM "
                                  "packing: gemm, exllama, ipex)")
        if qc.get("zero_point", True) is not True:
            raise CheckpointError(f"{source}: AWQ without zero points is not supported")
        return Scheme("awq", _group(qc.get("group_size", qc.get("q_group_size")), source), True)
    if method == "gptq":
        _bits(qc.get("bits"), source)
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise CheckpointError(f"{source}: GPTQ checkpoint_format {fmt!r} is not supported "
                                  "(gptq, gptq_v2)")
        return Scheme("gptq", _group(qc.get("group_size"), source), True, gptq_v1=fmt == "gptq",
                      actorder=bool(qc.get("desc_act")))
    if method == "compressed-tensors":
        if qc.get("format") != "pack-quantized":
            raise CheckpointError(f"{source}: compressed-tensors format {qc.get('format')!r} is "
                                  "not supported (pack-quantized W4A16 only)")
        groups = list((qc.get("config_groups") or {}).values())
        if len(groups) != 1 or not isinstance(groups[0], dict):
            raise CheckpointError(f"{source}: compressed-tensors with {len(groups)} config "
                                  "groups is not supported (one)")
        w = groups[0].get("weights") or {}
        _bits(w.get("num_bits"), source)
        if w.get("type", "int") != "int" or groups[0].get("input_activations"):
            raise CheckpointError(f"{source}: compressed-tensors scheme {w.get('type')!r} with "
                                  "activation quantization is not supported (int weights only)")
        strategy = w.get("strategy", "group")
        if strategy not in ("group", "channel"):
            raise CheckpointError(f"{source}: compressed-tensors strategy {strategy!r} is not "
                                  "supported (group, channel)")
        g = -1 if strategy == "channel" else _group(w.get("group_size"), source)
        return Scheme("compressed-tensors", g, not w.get("symmetric", True),
                      actorder=w.get("actorder") in ("group", "dynamic"))
    raise CheckpointError(f"{source}: quantization method {method!r} is not supported (awq, "
                          "gptq, compressed-tensors pack-quantized)")


def _bits(bits, source: str) -> None:
    if bits != 4:
        raise CheckpointError(f"{source}: {bits}-bit weights are not supported (4-bit only)")


def _group(g, source: str) -> int:
    if not isinstance(g, int) or isinstance(g, bool) or not (g == -1 or g >= 2):
        raise CheckpointError(f"{source}: group_size must be an integer >= 2 or -1, got {g!r}")
    return g


# ------------------------------------------------------------------------------ unpacking


def _nibbles(packed: np.ndarray, axis: int, order=tuple(range(8))) -> np.ndarray:
    """int32 [.., n, ..] -> uint8 [.., 8n, ..]: element 8k + j of `axis` from nibble order[j]
    of word k."""
    p = np.asarray(packed).astype(np.uint32)
    shifts = np.asarray(order, np.uint32) * 4
    p = np.moveaxis(p, axis, -1)
    q = ((p[..., None] >> shifts) & 0xF).astype(np.uint8)  # [.., n, 8]
    q = q.reshape(p.shape[:-1] + (8 * p.shape[-1],))
    return np.moveaxis(q, -1, axis)


@dataclass
class Int4Linear:
    """One linear layer's 4-bit weight: q uint8 [out, in] (0..15), scale / offset f32
    [out, groups], `group_of` [in] the group of each input (None: contiguous groups of g)."""

    name: str
    q: np.ndarray
    scale: np.ndarray
    offset: np.ndarray
    group_of: np.ndarray | None = None
    keep: bool = True  # False: `layout` declines, the loader takes dense()

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    def dense(self) -> np.ndarray:
        """The f32 weight [out, in]."""
        g = (np.arange(self.q.shape[1]) // self.group_size if self.group_of is None
             else self.group_of)
        return (self.q.astype(np.float32) * self.scale[:, g] + self.offset[:, g])

    def layout(self, fn: Callable, target: str, dtype, widen_to) -> QuantizedArray | None:
        """The int4 QuantizedArray of param `target` (`fn`: the plan's [out, in] -> param layout
        transform), its groups along the last contracted axis; None when they do not fit."""
        from jaxinfer.checkpoints.quantize import WEIGHT_REDUCE_AXES, weight_name

        if not self.keep or self.group_of is not None or "#" in target:
            return None  # dequantized: asked for, act-order groups, or an expert's slice
        g = self.group_size
        q = fn(self.q)
        ax = WEIGHT_REDUCE_AXES[weight_name(target)][-1]
        if q.shape[ax] % g or g % 2:
            return None
        # the group index of each param position must be constant over runs of g on `ax`
        gid = fn(np.broadcast_to(np.arange(self.q.shape[1], dtype=np.int32) // g, self.q.shape))
        first = np.take(gid, np.arange(0, q.shape[ax], g), axis=ax)
        if not np.array_equal(np.repeat(first, g, axis=ax), gid):
            return None

        def grouped(a):  # [out, groups] -> the param layout with `ax` divided by g
            return np.take(fn(np.repeat(a, g, axis=1)), np.arange(0, q.shape[ax], g), axis=ax)

        return QuantizedArray(
            values=jnp.asarray(pack_nibbles(q, ax)), scales=jnp.asarray(grouped(self.scale)),
            offsets=jnp.asarray(grouped(self.offset)), fmt="int4", mode="weight_only",
            reduce_axes=(ax,), group_size=g, group_axis=ax, dtype=jnp.dtype(dtype).name)


def _to_f32(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a, jnp.float32))  # bf16 through jax (numpy has none)


def _act_order(g_idx, n_in: int, groups: int) -> np.ndarray | None:
    """The group of each input, or None when they are the plain runs of n_in / groups."""
    gi = np.asarray(g_idx).astype(np.int64)
    if gi.shape != (n_in,) or groups < 1 or gi.min() < 0 or gi.max() >= groups:
        raise ValueError(f"g_idx of shape {gi.shape} must give each of {n_in} inputs a group "
                         f"in [0, {groups})")
    plain = n_in % groups == 0 and np.array_equal(gi, np.arange(n_in) // (n_in // groups))
    return None if plain else gi


def decode_linear(scheme: Scheme, name: str, t: dict[str, object]) -> Int4Linear:
    """The Int4Linear of the tensors `t` (suffix -> array) of linear `name`."""
    try:
        if scheme.method == "awq":
            q = _nibbles(t["qweight"], 1, AWQ_NIBBLE).T  # [out, in]
            z = _nibbles(t["qzeros"], 1, AWQ_NIBBLE).T  # [out, groups]
            s = _to_f32(t["scales"]).T
            group_of = None
        elif scheme.method == "gptq":
            q = _nibbles(t["qweight"], 0).T  # [out, in]
            z = _nibbles(t["qzeros"], 1).T.astype(np.int32) + (1 if scheme.gptq_v1 else 0)
            s = _to_f32(t["scales"]).T
            n_in, groups = q.shape[1], s.shape[1]
            group_of = None
            if "g_idx" in t:
                group_of = _act_order(t["g_idx"], n_in, groups)
        else:
            out_in = tuple(int(x) for x in np.asarray(t["weight_shape"]).tolist())
            q = _nibbles(t["weight_packed"], 1)[:, :out_in[1]]  # [out, in]
            s = _to_f32(t["weight_scale"])
            if s.ndim == 1:
                s = s[:, None]
            if "weight_zero_point" in t:
                zp = np.asarray(t["weight_zero_point"])
                if zp.dtype == np.int8:  # unpacked, signed
                    z = zp.astype(np.int32) + 8
                else:
                    z = _nibbles(zp, 0)[:out_in[0]].astype(np.int32)
            else:
                z = np.full(s.shape, 8, np.int32)
            group_of = None
            if "weight_g_idx" in t:
                group_of = _act_order(t["weight_g_idx"], q.shape[1], s.shape[1])
            if q.shape != out_in:
                raise ValueError(f"weight_packed holds {q.shape}, weight_shape says {out_in}")
    except KeyError as e:
        raise CheckpointError(f"{name}: missing {e.args[0]!r} for {scheme.method}") from None
    except ValueError as e:
        raise CheckpointError(f"{name}: {e}") from None
    if s.shape != z.shape[:2] or q.shape[0] != s.shape[0] or q.shape[1] % s.shape[1]:
        raise CheckpointError(f"{name}: {scheme.method} tensors disagree: values {q.shape}, "
                              f"scales {s.shape}, zeros {z.shape} ([out, in] / [out, groups])")
    g = q.shape[1] if scheme.group_size == -1 else scheme.group_size
    if s.shape[1] != -(-q.shape[1] // g):
        raise CheckpointError(f"{name}: {s.shape[1]} scale groups for {q.shape[1]} inputs, but "
                              f"quantization_config's group_size is {scheme.group_size}")
    return Int4Linear(name, q, s, (-z.astype(np.float32) * s).astype(np.float32), group_of)


def group_linears(tensors: Iterator[tuple[str, object, object]], scheme: Scheme,
                  keep: bool = True) -> Iterator[tuple[str, object, object]]:
    """The tensor stream with each quantized linear's parts replaced by one
    (`<linear>.weight`, Int4Linear, source) as soon as all its parts have passed. `keep`
    False: the linears are dequantized as they are placed. An undeclared g_idx is used when it
    comes before its linear's other tensors (sorted names put it first) and dropped after
    (without act-order the groups are runs of inputs anyway)."""
    parts = scheme.required
    pending: dict[str, dict[str, object]] = {}
    sources: dict[str, object] = {}
    done: set[str] = set()
    for name, arr, src in tensors:
        base, _, suffix = name.rpartition(".")
        if suffix in ("g_idx", "weight_g_idx") and suffix not in parts:
            if base not in done:
                pending.setdefault(base, {})[suffix] = arr
                sources[base] = src
            continue
        if suffix not in parts:
            yield name, arr, src
            continue
        got = pending.setdefault(base, {})
        got[suffix] = arr
        sources[base] = src
        if all(p in got for p in parts):
            del pending[base]
            done.add(base)
            lin = decode_linear(scheme, base, got)
            lin.keep = keep
            yield f"{base}.weight", lin, src
    for base, got in pending.items():
        missing = [p for p in parts if p not in got]
        raise CheckpointError(f"{sources[base]}: {base}: missing {missing} for {scheme.method}")
