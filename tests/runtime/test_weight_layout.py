"""Layer weights stored output-major (runtime/device/weight_layout.py): every einsum the model writes gives
jnp.einsum's result on the logical weight (rtol 1e-5: the same products summed in another order),
in one piece or two; the logical shape and weight come back; a whole model's logits are
unchanged; the engine stores them so on CPU unless told otherwise, and bad settings are refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.runtime.config import EngineConfig
from jaxinfer.runtime.device.weight_layout import (CONTRACTED_AXES, OutputMajor, output_major_layers,
                                            use_output_major)

# (weight name, spec as runtime/device/model.py writes it, x shape, w shape): Hkv = 1 as in Gemma 3
SPECS = [
    ("wq", "td,dhk->thk", (5, 16), (16, 4, 8)),
    ("wk", "td,dhk->thk", (1, 16), (16, 1, 8)),  # one head: the pieces split head_dim
    ("wo", "thk,hkd->td", (3, 4, 8), (4, 8, 16)),
    ("w_gate", "td,df->tf", (8, 16), (16, 24)),
    ("w_down", "tf,fd->td", (2, 24), (24, 16)),
    ("wqkv", "td,dhgk->thgk", (4, 16), (16, 1, 6, 8)),  # fused (runtime/device/fused_projections.py)
    ("w_gate_up", "td,dfc->tfc", (3, 16), (16, 24, 2)),
]


@pytest.mark.parametrize("name,spec,xs,ws", SPECS)
@pytest.mark.parametrize("pieces", [1, 2])
def test_einsum_equals_the_logical_product(name, spec, xs, ws, pieces):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(xs), jnp.float32)
    w = jnp.asarray(rng.standard_normal(ws), jnp.float32)
    om = OutputMajor.of(w, CONTRACTED_AXES[name], pieces)
    assert om.shape == ws and om.ndim == len(ws) and len(om.pieces) == pieces
    # stored output axes first: wq [D, Hq, Dh] -> [Hq, Dh, D]; wo [Hq, Dh, D] -> [D, Hq, Dh]
    stored = [ws[i] for i in om.order]
    stored[om.axis] //= pieces
    assert om.pieces[0].shape == tuple(stored)
    assert om.order[-len(CONTRACTED_AXES[name]):] == CONTRACTED_AXES[name]
    np.testing.assert_array_equal(np.asarray(om.logical()), np.asarray(w))
    want = jnp.einsum(spec, x, w, precision=jax.lax.Precision.HIGHEST)
    got = jax.jit(lambda x, om: om.einsum(spec, x))(x, om)
    assert got.shape == want.shape and got.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # a bf16 activation gets a bf16 result, as the dense path gives
    assert om.einsum(spec, x.astype(jnp.bfloat16)).dtype == jnp.bfloat16


def test_model_logits_unchanged_and_other_leaves_kept():
    from jaxinfer.runtime.config import ModelConfig
    from jaxinfer.runtime.device.model import init_params
    from tests.model_utils import assert_same_logits

    cfg = ModelConfig(family="llama", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=1, head_dim=8)
    params = init_params(cfg, jax.random.PRNGKey(0), scale=0.2)
    om = output_major_layers(params, pieces=2)
    lp = om.layers[1]
    assert all(isinstance(getattr(lp, f), OutputMajor) for f in CONTRACTED_AXES
               if getattr(params.layers[1], f) is not None)
    assert lp.attn_norm is params.layers[1].attn_norm and om.embed is params.embed
    assert output_major_layers(om, pieces=2).layers[1].wq is lp.wq  # applying twice: no change
    assert_same_logits(params, om, cfg, seed=3)


def test_engine_layout_setting():
    assert use_output_major("auto", "cpu") and not use_output_major("auto", "tpu")
    assert use_output_major("output_major", "gpu") and not use_output_major("as_loaded", "cpu")
    with pytest.raises(ValueError, match="weight_layout must be one of"):
        EngineConfig(weight_layout="column")
