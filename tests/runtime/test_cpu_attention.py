"""The CPU paged-attention kernel (runtime/device/cpu_attention.cc) against the XLA path
(`xla_ragged_paged_attention`, its reference) and a float64 numpy softmax; the engine's decode
programs on CPU call it, exports for TPU / CUDA do not."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.runtime.device import cpu_kernels
from jaxinfer.runtime.device.attention import cpu_paged_attention, xla_ragged_paged_attention

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no CPU kernels here")


def _case(seed=0, hkv=2, hq=8, dh=64, n_pages=64, ps=16, q_lens=(1, 1, 1, 1, 1),
          kv_lens=(5, 100, 17, 64, 1), slots=7, width=8, dead_rows=3):
    """A ragged batch: `len(q_lens)` live sequences of `slots`, pages drawn without repeats, rows
    past the live ones (and slots past num_seqs) of no sequence."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((hkv, n_pages, ps, dh)).astype(np.float32)
    v = rng.standard_normal((hkv, n_pages, ps, dh)).astype(np.float32)
    k[:, 0] = v[:, 0] = np.nan  # the null page: never read by a live row
    pages = rng.permutation(np.arange(1, n_pages))[:slots * width].reshape(slots, width)
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    cu = np.concatenate([cu, np.full(slots - len(q_lens), cu[-1])]).astype(np.int32)
    lens = np.zeros(slots, np.int32)
    lens[:len(kv_lens)] = kv_lens
    t = int(cu[-1]) + dead_rows
    q = rng.standard_normal((t, hq, dh)).astype(np.float32)
    return (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lens),
            jnp.asarray(pages.astype(np.int32)), jnp.asarray(cu),
            jnp.asarray([len(q_lens)], jnp.int32))


def _numpy(q, k, v, lens, pages, cu, num, sm_scale, window=None, cap=None, sinks=None):
    """float64 reference written from the definition (rows of no sequence 0)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    out = np.zeros_like(q)
    g = q.shape[1] // k.shape[0]
    ps = k.shape[2]
    for s in range(int(num[0])):
        for r in range(int(cu[s]), int(cu[s + 1])):
            pos = int(lens[s]) - (int(cu[s + 1]) - int(cu[s])) + r - int(cu[s])
            seen = [p for p in range(int(lens[s])) if p <= pos and (window is None
                                                                    or pos - p < window)]
            for h in range(q.shape[1]):
                kk = np.stack([k[h // g, pages[s, p // ps], p % ps] for p in seen])
                vv = np.stack([v[h // g, pages[s, p // ps], p % ps] for p in seen])
                sc = kk @ q[r, h] * sm_scale
                if cap:
                    sc = cap * np.tanh(sc / cap)
                logits = np.concatenate([sc, [] if sinks is None else [float(sinks[h])]])
                e = np.exp(logits - logits.max())
                out[r, h] = e[:len(seen)] @ vv / e.sum()
    return out


OPTIONS = [dict(), dict(sliding_window=16), dict(soft_cap=5.0), dict(sinks=True),
           dict(sliding_window=3, soft_cap=2.0, sinks=True)]


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(o) or "plain")
@pytest.mark.parametrize("layout", ["decode", "gqa1", "mqa", "prefill"])
def test_matches_xla_path_and_numpy(opts, layout):
    shape = {"decode": {}, "gqa1": dict(hkv=4, hq=4), "mqa": dict(hkv=1, hq=4, dh=256),
             "prefill": dict(q_lens=(3, 1, 9, 1), kv_lens=(7, 40, 9, 1))}[layout]
    args = _case(**shape)
    kw = dict(opts)
    if kw.pop("sinks", False):
        kw["sinks"] = jnp.asarray(np.random.default_rng(3).standard_normal(args[0].shape[1]),
                                  jnp.float32)
    max_q = int(np.max(np.diff(np.asarray(args[5]))))
    got = np.asarray(cpu_paged_attention(*args, sm_scale=0.125, **kw))
    xla = np.asarray(xla_ragged_paged_attention(*args, sm_scale=0.125, max_q_len=max_q, **kw))
    ref = _numpy(*args, 0.125, kw.get("sliding_window"), kw.get("soft_cap"), kw.get("sinks"))
    assert np.isfinite(got).all()  # the NaN null page is never read
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6 * np.abs(ref).max())
    np.testing.assert_allclose(got, xla, rtol=0, atol=2e-6 * np.abs(ref).max())
    live = int(np.asarray(args[5])[int(args[6][0])])
    assert not got[live:].any()  # rows of no sequence come back 0


@pytest.mark.skipif(shutil.which("taskset") is None or (os.cpu_count() or 1) < 2,
                    reason="needs taskset and at least 2 CPUs")
def test_each_row_alone_and_across_threads_bit_for_bit(tmp_path):
    """A row's result does not depend on the rows beside it (batch invariance) nor on the
    thread count (a one-core child process gives the same bits)."""
    args = _case(seed=1, kv_lens=(700, 650, 900, 512, 800), n_pages=400, width=64, slots=6)
    many = np.asarray(cpu_paged_attention(*args, sm_scale=0.1, sliding_window=600))
    q, k, v, lens, pages, cu, num = args
    for s in range(5):
        one = cpu_paged_attention(q[s:s + 1], k, v, lens[s:s + 1], pages[s:s + 1],
                                  jnp.asarray([0, 1], jnp.int32), jnp.asarray([1], jnp.int32),
                                  sm_scale=0.1, sliding_window=600)
        assert np.array_equal(np.asarray(one)[0], many[s])
    np.save(tmp_path / "many.npy", many)
    code = (
        "import numpy as np, sys; sys.path.insert(0, %r)\n"
        "from test_cpu_attention import _case, cpu_paged_attention\n"
        "a = _case(seed=1, kv_lens=(700, 650, 900, 512, 800), n_pages=400, width=64, slots=6)\n"
        "np.save(%r, np.asarray(cpu_paged_attention(*a, sm_scale=0.1, sliding_window=600)))\n"
    ) % (os.path.dirname(__file__), str(tmp_path / "one.npy"))
    subprocess.run(["taskset", "-c", "0", sys.executable, "-c", code], check=True,
                   env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert np.array_equal(np.load(tmp_path / "one.npy"), many)


def test_bad_shapes_raise():
    q, k, v, lens, pages, cu, num = _case()
    with pytest.raises(jax.errors.JaxRuntimeError, match="jaxinfer_paged_attention"):
        np.asarray(cpu_paged_attention(q, k, v, lens[:3], pages, cu, num, sm_scale=1.0))


def test_out_of_range_page_index_reads_the_null_page():
    """A corrupt page index never reads outside the pool (it reads page 0)."""
    q, k, v, lens, pages, cu, num = _case()
    bad = pages.at[0, 0].set(10**6)
    out = np.asarray(cpu_paged_attention(q, k, v, lens, bad, cu, num, sm_scale=1.0))
    assert np.isnan(out[0]).all()  # page 0 holds NaN here
    good = np.asarray(cpu_paged_attention(q, k, v, lens, pages, cu, num, sm_scale=1.0))
    assert np.array_equal(out[1:], good[1:])


def _decode_step_text(platform: str | None):
    """The HLO of a tiny Llama's decode-only step (T = S = 2), lowered for `platform`."""
    from jaxinfer.runtime.device.attention import attend, batch_metadata

    q = jnp.zeros((2, 4, 64), jnp.float32)
    k = jnp.zeros((2, 8, 16, 64), jnp.float32)
    md, _ = batch_metadata(2, 1, 16, table_pages=4)  # one row a sequence: a decode step
    f = lambda q, k: attend(q, k, k, md, sm_scale=0.1, sliding_window=None,  # noqa: E731
                            soft_cap=None, backend="xla")
    if platform is None:
        return jax.jit(f).lower(q, k).as_text()
    return jax.export.export(jax.jit(f), platforms=[platform])(q, k).mlir_module()


def test_decode_attention_calls_the_kernel_on_cpu_only():
    assert "jaxinfer_paged_attention" in _decode_step_text(None)
    for platform in ("tpu", "cuda"):
        assert "jaxinfer_paged_attention" not in _decode_step_text(platform)
