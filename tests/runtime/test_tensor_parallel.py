"""Tensor parallelism on 8 CPU devices: outputs identical across tp = 1/2/4/8, shards shrink
per-device bytes, orbax restores onto another layout, no recompiles under the mesh; the
multi-host plan codec and the leader/follower protocol on one machine.

Tests marked `on_8_devices` run together in one child pytest with
XLA_FLAGS=--xla_force_host_platform_device_count=8 (the device count is fixed when the backend
starts, and 8 devices for the whole suite would slow every other test); each reports its own
outcome from the child.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jaxinfer.runtime.device import distributed as dist
from jaxinfer.runtime.device import sharding as shd
from jaxinfer.runtime.config import ModelConfig
from jaxinfer.runtime.device.kv_cache import init_cache
from jaxinfer.runtime.device.model import init_params

from tests import background
from tests.model_utils import _fwd, single_sequence_metadata

ROOT = Path(__file__).resolve().parents[2]
CHILD_ENV = "JAXINFER_TP_CHILD"
TPS = (1, 2, 4, 8)

LLAMA = ModelConfig(  # 8 q / 8 kv heads: everything splits up to tp 8
    family="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
    num_heads=8, num_kv_heads=8, head_dim=16, tie_word_embeddings=False,
)
GEMMA = ModelConfig(  # Gemma 3 style: 4 q heads / 1 kv head, tied embeddings, qk norm
    family="gemma3", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=4, num_kv_heads=1, head_dim=32, qk_norm=True, sandwich_norms=True,
    tie_word_embeddings=True, activation="gelu_tanh", embed_scale=8.0,
    sliding_window=8, layer_types=("local", "global"), rope_local_theta=10000.0,
)

MOE = ModelConfig(  # Qwen-MoE style: 16 experts (top 4), a gated shared expert, q/k norms;
    # experts split up to tp 8
    family="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=8, num_kv_heads=4, head_dim=16, qk_norm=True, tie_word_embeddings=False,
    num_experts=16, experts_per_token=4, moe_intermediate_size=32, shared_expert_size=24,
    shared_expert_gate=True,
)


def on_8_devices(fn):
    """Run the test body with 8 host devices: one child pytest, started when collection ends
    (tests/background.py), runs every selected @on_8_devices test of this module and of the
    modules that import it (the child runs the bodies themselves); each test then reports its
    own outcome from the child (test names are unique across those modules)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if os.environ.get(CHILD_ENV):
            assert len(jax.devices()) >= 8, jax.devices()
            return fn(*args, **kwargs)
        outcome, detail = _child_outcomes().get(fn.__name__, ("not run", "missing from the child"))
        assert outcome == "passed", f"{fn.__name__} on 8 devices: {outcome}\n{detail}"

    return wrapper if os.environ.get(CHILD_ENV) else pytest.mark.background("tp8")(wrapper)


def _start_child(items, workdir: Path) -> background.Job:
    env = dict(os.environ, JAX_PLATFORMS="cpu", **{CHILD_ENV: "1"})
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        " --xla_force_host_platform_device_count=8").strip()
    tests = sorted({f"{Path(i.path).relative_to(ROOT)}::{i.originalname}" for i in items})
    return background.Job([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"--junitxml={workdir / 'child.xml'}", *tests],
                          env, workdir, timeout_s=1800)


background.register("tp8", _start_child)


@functools.cache
def _child_outcomes() -> dict[str, tuple[str, str]]:
    """{test name: (passed | failed | error | skipped, message)} from the child pytest."""
    import xml.etree.ElementTree as ET

    r = background.result("tp8")
    report = background.workdir("tp8") / "child.xml"
    if not report.exists():
        raise AssertionError(f"the 8-device child (exit {r.returncode}) wrote no report:\n"
                             f"{r.stdout[-4000:]}\n{r.stderr[-3000:]}")
    out = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        bad = [c for c in case if c.tag in ("failure", "error", "skipped")]
        out[case.get("name")] = ((bad[0].tag if bad[0].tag != "failure" else "failed",
                                  (bad[0].get("message") or "") + "\n" + (bad[0].text or "")[-6000:])
                                 if bad else ("passed", ""))
    return out


def _run_forward(params, cfg, mesh=None):
    """Prefill 19 tokens (all logits) then decode 2 more (a page boundary crossed)."""
    toks = np.arange(3, 22, dtype=np.int32) * 7 % cfg.vocab_size
    make = lambda: init_cache(cfg, 5, 8)
    if mesh is not None:  # traced on the mesh, as the engine's steps are (expert parallelism)
        params = shd.shard_params(params, mesh)
        cache = shd.init_sharded_cache(make, mesh)
    else:
        cache = make()
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        logits, cache = _fwd(params, jnp.asarray(toks), cache,
                             single_sequence_metadata(0, 19, 8, [1, 2, 3]), cfg, "xla")
        out = [np.asarray(logits)]
        for i, t in enumerate((5, 9)):
            lg, cache = _fwd(params, jnp.asarray([t], jnp.int32), cache,
                             single_sequence_metadata(19 + i, 1, 8, [1, 2, 3]), cfg, "xla")
            out.append(np.asarray(lg))
    return np.concatenate(out), cache


# ----------------------------------------------------------------------------- rules (1 device)


def test_rules_replicate_what_does_not_divide():
    mesh = shd.make_mesh(1)
    fake = type("FakeMesh", (), {"shape": {"data": 1, "model": 4}})()
    # GQA 4 q heads / 1 kv head on tp 4: q heads split, the single kv head replicated
    assert shd.mesh_spec(shd.PARAM_AXES["wq"], (64, 4, 32), fake) == P(None, "model")
    assert shd.mesh_spec(shd.PARAM_AXES["wk"], (64, 1, 32), fake) == P()
    assert shd.mesh_spec(shd.CACHE_AXES, (1, 10, 8, 32), fake) == P()
    assert shd.mesh_spec(shd.CACHE_AXES, (8, 10, 8, 32), fake) == P("model")
    # 6 heads do not split 4 ways; vocab 262144 does; one mesh axis is used once per array
    assert shd.mesh_spec(shd.PARAM_AXES["wo"], (6, 32, 64), fake) == P()
    assert shd.mesh_spec(shd.PARAM_AXES["embed"], (262144, 640), fake) == P("model")
    assert shd.mesh_spec(("heads", "mlp"), (4, 8), fake) == P("model")
    # a rank the table does not know is replicated, never mis-split
    assert shd.mesh_spec(shd.PARAM_AXES["wq"], (64, 4), fake) == P()
    assert shd.param_axes("layers.3.wq.values") == shd.PARAM_AXES["wq"]
    assert shd.param_axes("layers.3.scales") is None
    with pytest.raises(ValueError, match="needs 16 devices"):
        shd.make_mesh(16, devices=jax.devices()[:1])
    assert mesh.axis_names == shd.MESH_AXES


def test_automatic_split_over_cpu_devices_only_where_it_can_gain():
    """Hand-worked choices of auto_tensor_parallel: the largest count <= devices dividing both
    head counts, on one CPU host, for wide enough models in formats the TP tests cover."""
    import dataclasses

    from jaxinfer.runtime.config import EngineConfig
    from jaxinfer.runtime.device.host_devices import MIN_HIDDEN, auto_tensor_parallel

    e = EngineConfig()
    wide = dataclasses.replace(LLAMA, hidden_size=MIN_HIDDEN)  # 8 q / 8 kv heads

    def tp(cfg=wide, ecfg=e, **kw):
        return auto_tensor_parallel(cfg, ecfg, **({"platform": "cpu", "devices": 2} | kw))

    assert tp() == 2 and tp(devices=8) == 8 and tp(devices=6) == 4 and tp(devices=1) == 1
    assert tp(dataclasses.replace(wide, num_kv_heads=2), devices=8) == 2  # gcd(8, 2)
    assert tp(dataclasses.replace(GEMMA, hidden_size=640)) == 1  # one KV head: stays whole
    assert tp(LLAMA) == 1  # hidden 128: two all-reduces a layer cost more than they save
    assert tp(platform="gpu") == 1 and tp(processes=2) == 1
    for kw in ({"quantization": "int4"}, {"quantization": "gguf"},
               {"speculative": {"method": "ngram", "k": 2}},
               {"attention_backend": "pallas_interpret"}):
        assert tp(ecfg=EngineConfig(**kw)) == 1, kw
    assert tp(ecfg=EngineConfig(quantization="int8", quant_mode="w8a8")) == 2
    # weight-only int8 / fp8 stay on one device where the CPU kernels (every core) run them
    from jaxinfer.runtime.device import cpu_kernels

    split = 1 if cpu_kernels.load() is not None else 2
    assert tp(ecfg=EngineConfig(quantization="int8")) == split
    assert tp(ecfg=EngineConfig(quantization="fp8")) == split


def test_host_devices_count_is_checked(monkeypatch):
    from jax._src import xla_bridge

    from jaxinfer.runtime.device import host_devices

    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    for bad in ("two", "0"):
        monkeypatch.setenv("JAXINFER_HOST_DEVICES", bad)
        with pytest.raises(ValueError, match="JAXINFER_HOST_DEVICES"):
            host_devices.request_host_devices()


def test_quantized_leaves_shard_values_and_scales_alike():
    from jaxinfer.checkpoints.quantize import quantize_params
    from jaxinfer.runtime.device.tree_paths import path_names

    mesh_like = type("M", (), {"shape": {"data": 1, "model": 4}})()
    qp = jax.eval_shape(lambda: quantize_params(init_params(LLAMA, jax.random.key(0)), "int8"))
    specs = {}

    def visit(kp, leaf):
        path = ".".join(path_names(kp))
        specs[path] = shd.mesh_spec(shd.param_axes(path), tuple(leaf.shape), mesh_like)
        return leaf

    jax.tree_util.tree_map_with_path(visit, qp)
    assert specs["layers.0.wq.values"] == P(None, "model")  # [D, Hq, Dh]
    assert specs["layers.0.wq.scales"] == P(None, "model")  # [1, Hq, Dh]
    assert specs["layers.0.wo.values"] == P("model")  # [Hq, Dh, D] contracts heads
    assert specs["layers.0.wo.scales"] == P()  # [1, 1, D]: contracted axes are size 1
    assert specs["layers.0.w_down.values"] == P("model")
    assert specs["layers.0.w_down.scales"] == P()
    assert specs["embed.values"] == P("model") and specs["embed.scales"] == P("model")


# --------------------------------------------------------------------------- the plan channel


def _plan(t=16, s=4, p=3, seed=0, w=1):
    rng = np.random.default_rng(seed)
    i32 = lambda *sh: rng.integers(-5, 1 << 20, sh, dtype=np.int32)
    return dict(
        token_ids=i32(t), positions=i32(t), slot_mapping=i32(t), prompt_targets=i32(t),
        lora_ids=i32(t),
        cu_q_lens=i32(s + 1),
        kv_lens=i32(s), page_indices=i32(s, p), num_seqs=i32(1), logits_indices=i32(s),
        temperature=rng.random(s, dtype=np.float32),
        top_k=i32(s), top_p=np.array([1.0, 0.5, np.nan, -0.0][:s], np.float32),
        min_p=rng.random(s, dtype=np.float32),
        seeds=np.array([0, 1, 2**32 - 1, 2**31][:s], np.uint32), sample_positions=i32(s),
        constrained=i32(s), proc_slots=i32(s), token_bitmask=rng.integers(-2**31, 2**31, (s, w), dtype=np.int32),
    )


def test_plan_codec_round_trip_is_bit_exact():
    codec = dist.PlanCodec(max_tokens=64, max_seqs=4, max_pages=8, mask_words=5)
    for t, s, p, q, n, f in ((16, 4, 3, 1, 0, False), (64, 4, 8, 64, 20, True), (16, 1, 1, 16, 0, True)):
        arrays = _plan(t, s, p, w=1 + t % 5)
        buf = codec.pack(arrays, q, n, f)
        assert buf.shape == (codec.size,) and buf.dtype == np.int32  # one fixed-shape broadcast
        got, q2, n2, f2 = codec.unpack(buf)
        assert (q2, n2, f2) == (q, n, f)
        assert set(got) == set(arrays)
        for k, v in arrays.items():
            assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
            assert got[k].tobytes() == v.tobytes(), k  # NaN / -0.0 / uint32 max survive
    assert codec.unpack(codec.stop()) is None
    with pytest.raises(ValueError, match="capacity"):
        codec.pack(_plan(128, 4, 3), 1, 0, False)
    bad = _plan(16, 4, 3)
    bad["seeds"] = bad["seeds"].astype(np.int64)
    with pytest.raises(ValueError, match="seeds"):
        codec.pack(bad, 1, 0, False)
    with pytest.raises(ValueError, match="not a plan buffer"):
        codec.unpack(np.zeros(codec.size, np.int32))


def test_single_process_channel_sends_nothing_and_broadcast_is_identity():
    from jax.experimental import multihost_utils

    assert jax.process_count() == 1 and dist.is_leader()
    ch = dist.PlanChannel(dist.PlanCodec(16, 4, 3))
    ch.send(_plan(), 1, 0, False)  # nobody to receive: must neither block nor fail
    ch.send_stop()
    buf = dist.PlanCodec(16, 4, 3).pack(_plan(), 1, 0, False)
    assert np.array_equal(multihost_utils.broadcast_one_to_all(buf), buf)


def test_follower_replaying_broadcast_plans_matches_leader(tiny_dir):
    """The multi-host protocol on one machine: a leader engine broadcasts each step's plan;
    a follower engine (no scheduler use) replays them with `follow` and ends with the same
    cache, bit for bit, after running the same number of steps."""
    from jaxinfer import LLM, SamplingParams

    sent = []

    def leader_broadcast(buf, is_source):
        assert is_source
        sent.append(np.array(buf))
        return buf

    leader = LLM(str(tiny_dir), max_slots=2, page_size=8, max_model_len=64)
    codec = dist.PlanCodec(leader.engine.scheduler.token_buckets[-1], 2,
                          leader.engine.scheduler.page_buckets[-1],
                          leader.engine.scheduler.mask_words)
    leader.engine.plan_channel = dist.PlanChannel(codec, leader_broadcast)
    outs = leader.generate(["To be, or not to be", "Hello"],
                           SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    leader.engine.release_followers()
    assert all(len(o.token_ids) == 6 for o in outs)
    assert len(sent) >= 7 and codec.unpack(sent[-1]) is None

    follower = LLM(str(tiny_dir), max_slots=2, page_size=8, max_model_len=64)
    queue = iter(sent)

    def follower_broadcast(buf, is_source):
        assert not is_source and buf.shape == (codec.size,)
        return next(queue)

    follower.engine.leader = False
    follower.engine.plan_channel = dist.PlanChannel(codec, follower_broadcast)
    assert follower.engine.follow() == len(sent) - 1
    for a, b in zip(jax.tree.leaves(leader.engine.cache), jax.tree.leaves(follower.engine.cache)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert not follower.engine.num_unfinished  # the follower never scheduled anything itself


# ---------------------------------------------------------------------------- on 8 devices


def _init(cfg, seed: int):
    params = init_params(cfg, jax.random.key(seed))
    if cfg.num_experts:  # routers far from uniform: no near-ties in the top-k choice
        params = params.replace(layers=tuple(
            lp.replace(router=lp.router * 100) for lp in params.layers))
    return params


@on_8_devices
def test_forward_logits_match_across_tp_and_gqa_replication():
    for cfg in (LLAMA, GEMMA, MOE):
        params = _init(cfg, 1)
        ref, _ = _run_forward(params, cfg)
        for tp in TPS[1:]:
            mesh = shd.make_mesh(tp)
            got, cache = _run_forward(params, cfg, mesh)
            np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0, err_msg=f"{cfg.family} tp{tp}")
            assert (got.argmax(-1) == ref.argmax(-1)).all()
            sh = shd.shard_params(params, mesh)
            wq, wk = sh.layers[0].wq.sharding.spec, sh.layers[0].wk.sharding.spec
            if cfg is MOE:  # expert parallel: each device holds 16 / tp experts whole
                experts = [sh.layers[0].we_gate, sh.layers[0].we_up, sh.layers[0].we_down]
                assert all(a.sharding.spec == P("model") for a in experts)
                assert shd.bytes_per_device(experts) * tp == sum(a.nbytes for a in experts)
                assert sh.layers[0].router.sharding.spec == P()
            if cfg is GEMMA:  # 1 kv head: replicated; 4 q heads split when they divide
                assert wk == P() and cache.k[0].sharding.spec == P()
                assert shd.bytes_per_device(cache) == cache.nbytes
                assert wq == (P(None, "model") if tp <= 4 else P())
            elif cfg is LLAMA:
                assert wk == P(None, "model") and wq == P(None, "model")
                assert cache.k[0].sharding.spec == P("model")
                assert shd.bytes_per_device(cache) * tp == cache.nbytes


@on_8_devices
def test_expert_parallel_moves_no_weights_and_the_engine_matches_one_device():
    """Traced on the mesh (as the engine's steps are), an MoE layer runs each device's experts
    on the replicated tokens: its one collective is an all-reduce of the [T, D] output, for
    decode- and prefill-sized steps; no expert weight moves. The
    engine's greedy tokens at tp 4 equal one device's, and its own step programs (traced on
    its mesh) hold the same collectives: no expert weight gathered."""
    import re

    from jaxinfer.runtime.config import EngineConfig
    from jaxinfer.runtime.build import prepare
    from jaxinfer.runtime.engine import Engine
    from jaxinfer.runtime.device.moe import moe_mlp
    from jaxinfer.runtime.host.requests import SamplingParams
    from jaxinfer.tools.bench_device import _IdTokenizer

    mesh = shd.make_mesh(4)
    params = _init(MOE, 3)
    lp = shd.shard_params(params, mesh).layers[0]
    fn = jax.jit(lambda h, lp: moe_mlp(h, lp.router, lp.we_gate, lp.we_up, lp.we_down, k=4,
                                       norm_topk=False,
                                       glu=lambda g, u: jax.nn.silu(g) * u))
    for t in (2, 64):  # 8 and 256 pairs over 16 experts
        with jax.set_mesh(mesh):
            hlo = fn.lower(jnp.ones((t, 64)), lp).compile().as_text()
        assert re.findall(r"(all-gather|all-reduce|all-to-all|collective-permute|"
                          r"reduce-scatter)\(", hlo) == ["all-reduce"], t
        assert re.findall(r"= (\S+) all-reduce\(", hlo) == [f"f32[{t},64]{{1,0}}"], t
    tokens = []
    for tp in (1, 4):
        eng = Engine(prepare(MOE, params, _IdTokenizer(MOE.vocab_size),
                             EngineConfig(max_slots=2, max_model_len=64, tensor_parallel=tp,
                                          compile_mode="blocking")))
        sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        rids = [eng.add_request([3 + i, 40, 7 * i + 5] * 6, sp) for i in range(2)]
        done = {}
        while eng.num_unfinished:
            done |= {d.request_id: d.output for d in eng.step() if d.finished}
        tokens.append([done[r].token_ids for r in rids])
    assert tokens[0] == tokens[1] and all(len(t) == 8 for t in tokens[0])
    body = eng._step.body  # its table is the jitted function's: this engine's own programs
    bodies = [job.future.result().as_text() for key, job in body.table.items()
              if key[0] == body.fixed and job.future.done()]
    assert bodies
    for hlo in bodies:  # every layer's [T, D] output summed; nothing gathered
        ops = re.findall(r"= \S+ (all-gather|all-reduce|all-to-all|collective-permute|"
                         r"reduce-scatter)\(", hlo)
        assert ops and set(ops) == {"all-reduce"}, sorted(set(ops))


@on_8_devices
def test_row_parallel_products_sum_partials_in_device_order():
    """Batch-invariant mode on 4 devices: wo's product over heads split 4 ways equals each
    device's partial product, added ((p0 + p1) + p2) + p3 in numpy, bit for bit; without the
    mode it is XLA's partitioned product (equal within float tolerance). It lowers for TPU
    and CUDA as a gather of the partials."""
    from jax.sharding import NamedSharding

    from jaxinfer.runtime.device.fixed_sums import row_parallel_einsum

    mesh = shd.make_mesh(4)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 16, 4)).astype(np.float32)  # [T, H, K]
    w = rng.standard_normal((16, 4, 32)).astype(np.float32)  # [H, K, D]
    spec = "thk,hkd->td"
    parts = [np.asarray(jnp.einsum(spec, x[:, 4 * i:4 * i + 4], w[4 * i:4 * i + 4],
                                   preferred_element_type=jnp.float32)) for i in range(4)]
    want = ((parts[0] + parts[1]) + parts[2]) + parts[3]
    xs = jax.device_put(x, NamedSharding(mesh, P(None, "model")))
    ws = jax.device_put(w, NamedSharding(mesh, P("model")))
    for invariant in (True, False):
        with jax.set_mesh(mesh):
            got = np.asarray(jax.jit(lambda a, b: row_parallel_einsum(spec, a, b, invariant))(
                xs, ws))
        if invariant:
            assert np.array_equal(got, want)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # and so it lowers for the accelerators: a gather of the partials, no all-reduce
    fn = jax.jit(lambda a, b: row_parallel_einsum(spec, a, b, True))
    for platform in ("tpu", "cuda"):
        with jax.set_mesh(mesh):
            text = jax.export.export(fn, platforms=[platform])(
                *(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
                  for a in (xs, ws))).mlir_module()
        assert "all_gather" in text and "all_reduce" not in text, platform


@on_8_devices
def test_quantized_params_shard_and_match():
    from jaxinfer.checkpoints.quantize import quantize_params

    mesh = shd.make_mesh(4)
    for cfg in (LLAMA, MOE):
        qp = quantize_params(_init(cfg, 2), "int8")
        ref, _ = _run_forward(qp, cfg)
        got, _ = _run_forward(qp, cfg, mesh)
        np.testing.assert_allclose(got, ref, atol=1e-4, rtol=1e-4, err_msg=str(cfg.num_experts))
        sq = shd.shard_params(qp, mesh)
        assert sq.layers[0].wq.values.sharding.spec == P(None, "model")
        assert sq.layers[0].wq.scales.sharding.spec == P(None, "model")
        assert sq.layers[0].wq.mode == qp.layers[0].wq.mode  # static fields kept
    for w in (sq.layers[0].we_gate, sq.layers[0].we_down):  # int8 experts, split by expert
        assert w.values.sharding.spec == P("model") and w.scales.sharding.spec == P("model")


@on_8_devices
def test_int8_smoothing_under_tp_equals_single_device(tmp_path):
    """LLM(quantization="int8") smooths (norm weights change) the same way with params
    streamed into shards as on one device, and the result is sharded by the rules."""
    from jaxinfer import LLM

    d = _write_model(tmp_path / "llama", "llama")
    # W8A8 (what smoothing is for; int8's CPU default is weight-only where the kernels load)
    one = LLM(str(d), quantization="int8", quant_mode="w8a8", max_slots=2, page_size=8,
              max_model_len=64)
    tp = LLM(str(d), quantization="int8", quant_mode="w8a8", tensor_parallel=4, max_slots=2,
             page_size=8, max_model_len=64)
    plain = LLM(str(d), max_slots=2, page_size=8, max_model_len=64)
    a, b = one.engine.params.layers[0], tp.engine.params.layers[0]
    assert not np.allclose(np.asarray(a.attn_norm), np.asarray(plain.engine.params.layers[0].attn_norm))
    np.testing.assert_allclose(np.asarray(b.attn_norm), np.asarray(a.attn_norm), rtol=1e-6)
    # one device keeps Q/K/V apart (CPU's output-major default); the shards hold them fused
    from jaxinfer.runtime.device.fused_projections import fuse_layer

    np.testing.assert_array_equal(np.asarray(b.wqkv.values), np.asarray(fuse_layer(a).wqkv.values))
    assert b.wqkv.values.sharding.spec == P(None, "model")


@on_8_devices
def test_per_device_param_bytes_shrink_with_tp():
    params = init_params(LLAMA, jax.random.key(0))
    norms = sum(a.nbytes for a in jax.tree.leaves(params) if a.ndim == 1)
    total = sum(a.nbytes for a in jax.tree.leaves(params))
    for tp in TPS:
        sh = shd.shard_params(params, shd.make_mesh(tp))
        per_dev = shd.bytes_per_device(sh)
        sharded = [a for a in jax.tree.leaves(sh) if a.ndim > 1]
        assert tp == 1 or all(a.sharding.spec != P() for a in sharded)
        # every matrix shrinks exactly 1/tp; only the [D] norm vectors stay whole
        assert shd.bytes_per_device(sharded) * tp == sum(a.nbytes for a in sharded)
        assert per_dev == (total - norms) // tp + norms
        # each device holds distinct slices: the shards tile the array
        a = sh.layers[0].w_up
        assert len({str(s.index) for s in a.addressable_shards}) == tp


@on_8_devices
def test_orbax_save_tp1_restore_tp4_bit_identical(tmp_path):
    from jaxinfer.checkpoints.orbax_io import load_converted, save_converted

    params = init_params(GEMMA, jax.random.key(3))
    save_converted(tmp_path / "ck", GEMMA, params, source="test")
    mesh = shd.make_mesh(4)
    cfg, got = load_converted(tmp_path / "ck", mesh=mesh)
    assert cfg == GEMMA
    want_sh = shd.param_shardings(params, mesh)
    for a, b, s in zip(jax.tree.leaves(params), jax.tree.leaves(got), jax.tree.leaves(want_sh)):
        assert b.sharding.is_equivalent_to(s, b.ndim) and len(b.sharding.device_set) == 4
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert got.layers[0].wq.sharding.spec == P(None, "model")  # arrived split, not replicated
    # and back: save the tp-4 layout, restore on one device
    save_converted(tmp_path / "ck4", GEMMA, got, source="test")
    _, back = load_converted(tmp_path / "ck4")
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def _write_model(out: Path, family: str) -> Path:
    """A random-init HF checkpoint (8 q / 8 kv Llama, or 4 q / 1 kv Gemma 3) + a small
    sentencepiece tokenizer."""
    import torch
    import transformers
    from jaxinfer.tools.make_test_model import train_tokenizer

    out.mkdir(parents=True)
    torch.manual_seed(0)
    if family == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512,
            bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(cfg).eval()
    else:
        from tests.gemma_fixtures import TINY_GEMMA_LAYER_TYPES

        cfg = transformers.Gemma3TextConfig(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=8,
            query_pre_attn_scalar=24, layer_types=TINY_GEMMA_LAYER_TYPES,
            max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        model = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # sharpen logits so greedy choices are far from ties
        model.get_output_embeddings().weight.mul_(10.0)
    model.save_pretrained(out, safe_serialization=True)
    (out / "tokenizer.model").write_bytes(train_tokenizer(512))
    (out / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True}))
    return out


PROMPTS = ["To be, or not to be", "Hello", "Now is the winter of our discontent " * 3, "O"]
# Whole engines at the mesh sizes that differ in what they shard (the forward test above runs
# every size): tp 4 splits every head of both models, tp 8 leaves Gemma's 4 q heads replicated.
LLM_TPS = (1, 4, 8)


@on_8_devices
def test_llm_greedy_tokens_identical_across_tp_and_no_recompiles(tmp_path):
    from jaxinfer import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for family in ("llama", "gemma"):
        d = _write_model(tmp_path / family, family)
        outs = {}
        for tp in LLM_TPS:
            llm = LLM(str(d), tensor_parallel=tp, max_slots=4, page_size=8, max_model_len=96,
                      prefill_chunk=16)
            if tp == 4:  # steady state under the mesh compiles nothing new after warm-up
                assert llm.engine.warmup() > 0
                before = llm.engine.compile_count
            outs[tp] = [o.token_ids for o in llm.generate(PROMPTS, greedy)]
            if tp == 4:
                assert llm.engine.compile_count == before
            p = llm.engine.params
            assert len(p.embed.sharding.device_set) == tp
            if tp > 1:
                assert p.embed.sharding.spec == P("model")
                assert llm.engine.cache.k[0].sharding.spec == (
                    P("model") if family == "llama" else P())
        assert all(len(t) == 12 for t in outs[1])
        for tp in LLM_TPS[1:]:
            assert outs[tp] == outs[1], (family, tp)


@on_8_devices
def test_lora_adapters_under_tp_identical_to_one_device(tmp_path):
    """Two PEFT adapters and the base model in one batch: the same tokens at tp 1, 2 and 4;
    the adapters' B halves split over the model axis like their base weights' outputs."""
    import copy

    import peft
    import torch
    import transformers

    from jaxinfer import LLM, LoRARequest, SamplingParams

    d = _write_model(tmp_path / "llama", "llama")
    reqs = []
    for i, targets in enumerate((["q_proj", "v_proj", "o_proj"], ["gate_proj", "down_proj"])):
        torch.manual_seed(i)
        base = transformers.LlamaForCausalLM.from_pretrained(d)
        pm = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
        pm.save_pretrained(tmp_path / f"ad{i}")
        reqs.append(LoRARequest(f"ad{i}", i + 1, str(tmp_path / f"ad{i}")))
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    which = [None, reqs[0], reqs[1], reqs[0]]
    outs = {}
    for tp in (1, 2, 4):
        llm = LLM(str(d), tensor_parallel=tp, enable_lora=True, max_loras=2, max_lora_rank=8,
                  max_slots=4, page_size=8, max_model_len=96, prefill_chunk=16)
        outs[tp] = [o.token_ids for o in llm.generate(PROMPTS, greedy, lora_request=which)]
        if tp > 1:
            lp = llm.engine.params.lora[0]
            assert lp.b["q"].sharding.spec == P(None, None, "model")
            assert lp.a["o"].sharding.spec == P(None, "model")
    plain = LLM(str(d), max_slots=4, page_size=8, max_model_len=96, prefill_chunk=16)
    base_only = [o.token_ids for o in plain.generate(PROMPTS, greedy)]
    assert outs[1][0] == base_only[0] and outs[1][1] != base_only[1]  # adapters took effect
    assert outs[2] == outs[1] and outs[4] == outs[1]


@on_8_devices
def test_cli_tensor_parallel_flag(tmp_path):
    from jaxinfer.serve.cli import build_parser
    from jaxinfer.serve.engine_args import llm_from_args

    d = _write_model(tmp_path / "m", "llama")
    args = build_parser().parse_args(["generate", "--model", str(d), "--tensor-parallel", "2",
                                      "--max-model-len", "64", "hi"])
    assert args.tensor_parallel == 2
    llm = llm_from_args(args)
    assert llm.config.tensor_parallel == 2
    assert llm.engine.params.layers[0].w_gate_up.sharding.spec == P(None, "model")
    with pytest.raises(ValueError, match="needs 16 devices"):
        llm_from_args(build_parser().parse_args(
            ["generate", "--model", str(d), "--tensor-parallel", "16", "hi"]))


@on_8_devices
def test_cpu_devices_split_a_wide_enough_model_unless_told_otherwise(tmp_path, monkeypatch):
    """No --tensor-parallel on a CPU host with 8 devices: the 8 q / 8 kv head model splits over
    all 8 once it counts as wide enough (the bar lowered to its width here), the same greedy
    tokens as one device; `--tensor-parallel 1` keeps it on one."""
    from jaxinfer import SamplingParams
    from jaxinfer.runtime.device import host_devices
    from jaxinfer.serve.cli import build_parser
    from jaxinfer.serve.engine_args import llm_from_args

    d = _write_model(tmp_path / "m", "llama")
    argv = ["generate", "--model", str(d), "--max-model-len", "64", "--max-slots", "4", "hi"]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    narrow = llm_from_args(build_parser().parse_args(argv))
    assert narrow.config.tensor_parallel == 1  # hidden 128 < MIN_HIDDEN
    monkeypatch.setattr(host_devices, "MIN_HIDDEN", 128)
    auto = llm_from_args(build_parser().parse_args(argv))
    assert auto.config.tensor_parallel == 8 and auto.engine.mesh.shape["model"] == 8
    assert auto.engine.params.layers[0].wqkv.sharding.spec == P(None, "model")
    one = llm_from_args(build_parser().parse_args(argv[:1] + ["--tensor-parallel", "1"]
                                                  + argv[1:]))
    assert one.config.tensor_parallel == 1 and one.engine.mesh is None
    want = [o.token_ids for o in one.generate(PROMPTS, greedy)]
    assert [o.token_ids for o in auto.generate(PROMPTS, greedy)] == want
    assert [o.token_ids for o in narrow.generate(PROMPTS, greedy)] == want


@on_8_devices
def test_pallas_kernel_under_shard_map_matches_unsharded():
    from jaxinfer.pallas_kernels.ragged_paged_attention import ragged_paged_attention

    rng = np.random.default_rng(0)
    hq, hkv, dh, ps, n = 8, 4, 64, 8, 9
    q = jnp.asarray(rng.standard_normal((24, hq, dh)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((hkv, n, ps, dh)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((hkv, n, ps, dh)), jnp.float32)
    kv_lens = jnp.asarray([20, 5, 0], jnp.int32)
    pages = jnp.asarray([[3, 1, 7], [2, 0, 0], [0, 0, 0]], jnp.int32)
    cu = jnp.asarray([0, 20, 21, 21], jnp.int32)
    ns = jnp.asarray([2], jnp.int32)
    kw = dict(sm_scale=dh ** -0.5, platform="tpu", interpret=True)
    ref = ragged_paged_attention(q, k, v, kv_lens, pages, cu, ns, **kw)
    mesh = shd.make_mesh(4)
    fn = jax.jit(shd.shard_kv_heads(ragged_paged_attention, mesh),
                 static_argnames=("sm_scale", "platform", "interpret"))
    rep = shd.replicated(mesh)
    pool = jax.sharding.NamedSharding(mesh, P("model"))
    got = fn(jax.device_put(q, jax.sharding.NamedSharding(mesh, P(None, "model"))),
             jax.device_put(k, pool), jax.device_put(v, pool),
             *(jax.device_put(a, rep) for a in (kv_lens, pages, cu, ns)), **kw)
    assert got.sharding.spec == P(None, "model")
    np.testing.assert_allclose(np.asarray(got)[:21], np.asarray(ref)[:21], atol=1e-5, rtol=1e-5)
