"""Mixture-of-experts feed-forward: a softmax router picks k of E experts per token, each a gated
MLP, and the token's output is their routing-weighted sum (Qwen3-MoE, Mixtral, gpt-oss).

`moe_mlp` is the serving path. Each (token, expert) pair meets only its own expert's weights and
no token is dropped. On TPU/GPU up to E pairs (decode) gather the chosen experts' weights per
pair, and more pairs (prefill) are sorted by expert and multiplied with `jax.lax.ragged_dot`
over contiguous groups; on CPU the sorted pairs run in blocks padded per expert. Expert
weights may be QuantizedArrays (int8, fp8, int4, GGUF blocks): each form widens only the
experts it reads. `moe_mlp_dense` computes every expert for every token and masks: E/k times
the work, kept as the test
reference.

    logits = h @ router (+ router_bias)        # [T, E], f32
    w, e = top_k(softmax(logits), k)           # [T, k] (renormalised to sum 1 if norm_topk)
    out[t] = sum_j w[t, j] * down_e(glu(gate_e(h[t]), up_e(h[t])))   with e = e[t, j]
glu(g, u) is act(g) * u (gpt-oss: a clamped form, runtime/device/model.py); with `biases`
(gpt-oss) each expert's gate / up / down add their own bias [E, F] / [E, F] / [E, D].
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxinfer.runtime.config import ModelConfig

from jaxinfer.runtime.device.fixed_sums import ordered_sum, split_over
from jaxinfer.runtime.device.quantization import QuantizedArray, dequantize


@dataclasses.dataclass(frozen=True)
class Routing:
    """How scores become choices beyond top-k of a softmax (DeepSeek-V3): sigmoid scores, the
    choice made on score + a per-expert bias among the best `topk_groups` of `groups` expert
    groups (a group's worth: the sum of its two best), weights scaled by `scale`."""

    scoring: str = "softmax"  # "softmax" | "sigmoid"
    groups: int = 1
    topk_groups: int = 1
    scale: float = 1.0


def routing_of(cfg: ModelConfig) -> Routing:
    return Routing(cfg.router_scoring, cfg.router_groups, cfg.router_topk_groups,
                   cfg.routed_scaling)


def route(h: jax.Array, router: jax.Array, k: int, norm_topk: bool, bias=None,
          routing: Routing = Routing(), choice_bias=None, expert_scale=None):
    """h [T, D], router [D, E], bias [E] | None (added to the logits), choice_bias [E] | None
    (added to the scores for the choice only), expert_scale [E] | None (multiplies the chosen
    experts' final weights, Gemma 4) -> (weights [T, k] f32, experts [T, k] int32).
    Softmax, top k, renormalised equals gpt-oss's softmax over the top k logits."""
    logits = jnp.einsum("td,de->te", h.astype(jnp.float32), router.astype(jnp.float32))
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    if routing.scoring == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
    choice = scores if choice_bias is None else scores + choice_bias.astype(jnp.float32)
    if routing.groups > 1:  # only the experts of the best topk_groups groups stay choosable
        t, n = choice.shape
        grouped = choice.reshape(t, routing.groups, n // routing.groups)
        worth = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, G]
        _, best = jax.lax.top_k(worth, routing.topk_groups)
        keep = jnp.zeros_like(worth, bool).at[jnp.arange(t)[:, None], best].set(True)
        choice = jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(t, n)
    _, e = jax.lax.top_k(choice, k)
    w = jnp.take_along_axis(scores, e, axis=-1)
    if norm_topk:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + (1e-20 if routing.scoring == "sigmoid"
                                                         else 0.0))
    if routing.scale != 1.0:
        w = w * routing.scale
    if expert_scale is not None:
        w = w * expert_scale.astype(jnp.float32)[e]
    return w, e.astype(jnp.int32)


def moe_mlp(h: jax.Array, router, we_gate, we_up, we_down, *, k: int, norm_topk: bool,
            glu, router_bias=None, biases=None, routing: Routing = Routing(),
            choice_bias=None, expert_scale=None, route_input=None,
            fixed_blocks: bool = False) -> jax.Array:
    """h [T, D]; we_gate / we_up [E, D, F], we_down [E, F, D] (arrays or QuantizedArrays) ->
    [T, D]. TPU/GPU: at most E pairs (a decode step) gather their experts' weights
    (`_gathered`), more are grouped by expert through ragged_dot (`_grouped`). CPU: blocks
    padded per expert (`_blocked`), at every size: XLA:CPU expands ragged_dot into a product
    over every expert, and widening gathered weights cost more than the blocks (tools/bench_moe).
    All read only the chosen experts. Traced on a mesh whose "model" axis
    divides E (the engine's tensor-parallel steps), each device runs its own E / tp experts on
    the (replicated) tokens and the partial outputs are summed: `_expert_parallel`.
    route_input [T, D]: what the router reads when it is not h (Gemma 4). `fixed_blocks`
    (batch-invariant mode, h one block of rows of a fixed count): `_blocked` on every platform,
    so a row's expert products have one shape whatever its neighbours chose, and its k
    outputs are summed in rank order (no scatter-add, whose order a GPU leaves open)."""
    w, e = route(h if route_input is None else route_input, router, k, norm_topk, router_bias,
                 routing, choice_bias, expert_scale)
    args = (h, w, e, we_gate, we_up, we_down, biases)
    mesh = jax.sharding.get_abstract_mesh()
    tp = 1 if mesh.empty or "model" not in mesh.axis_names else mesh.shape["model"]
    if tp > 1 and we_gate.shape[0] % tp == 0:
        return _expert_parallel(mesh, *args, glu=glu, fixed_blocks=fixed_blocks).astype(h.dtype)
    return _forms(*args, glu=glu, fixed_blocks=fixed_blocks).astype(h.dtype)


def _forms(h, w, e, we_gate, we_up, we_down, biases, *, glu, fixed_blocks=False) -> jax.Array:
    """f32 [T, D] by the platform's form for T * k pairs over these E experts; experts e >= E
    are held elsewhere and add nothing."""
    if fixed_blocks:
        return _blocked(h, w, e, we_gate, we_up, we_down, biases, glu)
    small = h.shape[0] * e.shape[1] <= we_gate.shape[0]
    return jax.lax.platform_dependent(
        h, w, e, we_gate, we_up, we_down, biases, cpu=functools.partial(_blocked, glu=glu),
        default=functools.partial(_gathered if small else _grouped, glu=glu))


def _bias(biases, i: int, idx: jax.Array) -> jax.Array | float:
    """Bias i (0 gate, 1 up, 2 down) of experts idx (any int shape S; clamped): f32 S + [F|D],
    or 0 without biases."""
    if biases is None:
        return 0.0
    b = biases[i]
    return b[jnp.minimum(idx, b.shape[0] - 1)].astype(jnp.float32)


def _expert_parallel(mesh, h, w, e, we_gate, we_up, we_down, biases, *, glu,
                     fixed_blocks=False) -> jax.Array:
    """Expert parallelism over the mesh's "model" axis: device i holds experts
    [i * E/tp, (i + 1) * E/tp) whole and the routed tokens are replicated, so each device
    applies its experts to the pairs that chose them (the others map past its last expert and
    add nothing) and one all-reduce of [T, D] sums the devices' outputs (with `fixed_blocks`
    on > 2 devices: gathered and summed in device order, runtime/device/fixed_sums.py). No
    weight moves between devices."""
    local = we_gate.shape[0] // mesh.shape["model"]
    ordered = split_over(we_gate.shape[0]) if fixed_blocks else 0

    def on_device(h, w, e, we_gate, we_up, we_down, biases):
        le = e - jax.lax.axis_index("model") * local  # [T, k] expert ids on this device
        le = jnp.where((le >= 0) & (le < local), le, local)
        y = _forms(h, w, le, we_gate, we_up, we_down, biases, glu=glu, fixed_blocks=fixed_blocks)
        return ordered_sum(y, ordered) if ordered else jax.lax.psum(y, "model")

    rep, split = jax.sharding.PartitionSpec(), jax.sharding.PartitionSpec("model")
    return jax.shard_map(on_device, mesh=mesh,
                         in_specs=(rep, rep, rep, split, split, split, split),
                         out_specs=rep, check_vma=False)(h, w, e, we_gate, we_up, we_down, biases)


def _experts(w, idx: jax.Array) -> jax.Array:
    """Experts `idx` (any int shape S; past the last: clamped) of a stacked [E, ...] weight,
    widened: f32 S + [...]."""
    idx = jnp.minimum(idx, w.shape[0] - 1)
    if isinstance(w, QuantizedArray):
        return w.take(idx).dequantize(jnp.float32)
    return w[idx].astype(jnp.float32)


def _gathered(h, w, e, we_gate, we_up, we_down, biases, glu) -> jax.Array:
    """Pair (t, j) multiplies h[t] by expert e[t, j]'s own weights, gathered: [T, k, D, F]."""
    x = h.astype(jnp.float32)
    w = jnp.where(e < we_gate.shape[0], w, 0.0)  # [T, k] (held elsewhere: 0)
    g = jnp.einsum("td,tkdf->tkf", x, _experts(we_gate, e)) + _bias(biases, 0, e)
    u = jnp.einsum("td,tkdf->tkf", x, _experts(we_up, e)) + _bias(biases, 1, e)
    y = jnp.einsum("tkf,tkfd->tkd", glu(g, u), _experts(we_down, e))  # [T, k, D]
    y = y + _bias(biases, 2, e)
    return jnp.einsum("tkd,tk->td", y, w)


def _sorted_pairs(e: jax.Array, e_count: int):
    """The T*k (token, expert) pairs sorted by expert: (order [P] pair indices, sorted experts
    [P] (ids >= E, held elsewhere, last), sizes [E] pairs per expert)."""
    flat_e = e.reshape(-1)  # [P] expert of pair p = t * k + j
    order = jnp.argsort(flat_e, stable=True)
    sizes = jnp.bincount(flat_e, length=e_count + 1)[:e_count].astype(jnp.int32)
    return order, flat_e[order], sizes


def _grouped(h, w, e, we_gate, we_up, we_down, biases, glu) -> jax.Array:
    """The pairs sorted by expert, each group multiplied by its expert with ragged_dot."""
    t, _ = h.shape
    k = e.shape[1]
    order, row_e, sizes = _sorted_pairs(e, we_gate.shape[0])
    tok = order // k  # [P] token of each sorted pair
    x = h[tok]  # [P, D]
    g = _ragged(x, we_gate, sizes, row_e)  # [P, F]
    u = _ragged(x, we_up, sizes, row_e)
    if biases is not None:
        g = g + _bias(biases, 0, row_e).astype(g.dtype)
        u = u + _bias(biases, 1, row_e).astype(u.dtype)
    y = _ragged(glu(g, u), we_down, sizes, row_e).astype(jnp.float32)  # [P, D]
    y = y + _bias(biases, 2, row_e)
    y = jnp.where((row_e < we_gate.shape[0])[:, None], y * w.reshape(-1)[order][:, None], 0.0)
    return jnp.zeros((t, h.shape[1]), jnp.float32).at[tok].add(y)


def _ragged(x, w, sizes, row_e) -> jax.Array:
    """ragged_dot of rows x [P, In] grouped by expert (sizes [E]) with w [E, In, Out]. A weight
    scaled per output channel is multiplied as its values, the row's expert's scale applied to
    the product; per-group scales (int4, GGUF blocks) are widened first."""
    if isinstance(w, QuantizedArray) and not w.group_size:
        y = jax.lax.ragged_dot(x, w.values.astype(x.dtype), sizes,
                               preferred_element_type=jnp.float32)
        return (y * w.scales[row_e, 0]).astype(x.dtype)  # scales [E, 1, Out]
    return jax.lax.ragged_dot(x, dequantize(w, x.dtype), sizes)


def block_rows(pairs: int, e_count: int) -> int:
    """`_blocked`'s rows a block: the pairs an expert gets on average (a power of two, 8..128)."""
    return max(8, min(128, 1 << max(0, (pairs // e_count).bit_length() - 1)))


def _blocked(h, w, e, we_gate, we_up, we_down, biases, glu) -> jax.Array:
    """The sorted pairs padded per expert to whole blocks of B rows; each block is multiplied by
    its expert's weights, read where they lie (`lax.map` over the blocks: XLA:CPU ran the
    batched product over gathered weights 4-7x slower). Padded rows <= P + B per used expert,
    so the blocks are at most ceil(P / B) + min(E, P): a static count."""
    t, d = h.shape
    k, e_count = e.shape[1], we_gate.shape[0]
    p = t * k
    b = block_rows(p, e_count)
    nb = -(-p // b) + min(e_count, p)
    order, row_e, sizes = _sorted_pairs(e, e_count)
    padded = (sizes + b - 1) // b * b  # [E]
    ends = jnp.cumsum(padded)  # [E] end row of each expert's blocks
    dest = (ends - padded)[row_e] + jnp.arange(p) - (jnp.cumsum(sizes) - sizes)[row_e]  # [P]
    dest = jnp.where(row_e < e_count, dest, nb * b)  # held elsewhere: no row
    block_e = jnp.minimum(jnp.searchsorted(ends, jnp.arange(nb) * b, side="right"),
                          e_count - 1)  # [nb] (blocks past the last expert: zero rows)
    x = jnp.zeros((nb * b, d), jnp.float32).at[dest].set(h[order // k].astype(jnp.float32),
                                                          mode="drop")

    def block(args):  # x [B, D], one expert
        x, i = args
        g = x @ _experts(we_gate, i) + _bias(biases, 0, i)  # [B, F]
        u = x @ _experts(we_up, i) + _bias(biases, 1, i)
        return glu(g, u) @ _experts(we_down, i) + _bias(biases, 2, i)  # [B, D]

    y = jax.lax.map(block, (x.reshape(nb, b, d), block_e)).reshape(nb * b, d)
    row = jnp.zeros_like(dest).at[order].set(dest)  # [P] block row of pair t * k + j
    y = jnp.take(y, row, axis=0, mode="fill", fill_value=0.0).reshape(t, k, d)
    return jnp.einsum("tkd,tk->td", y, w)  # each token's k outputs summed in rank order


def moe_mlp_dense(h: jax.Array, router, we_gate, we_up, we_down, *, k: int, norm_topk: bool,
                  glu, router_bias=None, biases=None, routing: Routing = Routing(),
                  choice_bias=None) -> jax.Array:
    """The reference: every expert on every token, weighted by the (sparse) routing weights."""
    w, e = route(h, router, k, norm_topk, router_bias, routing, choice_bias)
    dense_w = jnp.zeros((h.shape[0], we_gate.shape[0]), jnp.float32)
    dense_w = dense_w.at[jnp.arange(h.shape[0])[:, None], e].set(w)  # [T, E]
    hf = h.astype(jnp.float32)
    b = (0.0, 0.0, 0.0) if biases is None else [x.astype(jnp.float32) for x in biases]
    g = jnp.einsum("td,edf->tef", hf, dequantize(we_gate)) + b[0]
    u = jnp.einsum("td,edf->tef", hf, dequantize(we_up)) + b[1]
    y = jnp.einsum("tef,efd->ted", glu(g, u), dequantize(we_down)) + b[2]  # [T, E, D]
    return jnp.einsum("ted,te->td", y, dense_w).astype(h.dtype)
