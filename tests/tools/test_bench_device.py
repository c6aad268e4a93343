"""`jaxinfer bench device --smoke`: the accelerator proof kit runs end to end on CPU (tiny
shapes, interpret-mode kernels), so it cannot rot between device loans. `--cpu-scale N`: every
case of the full run at dimensions divided by N, labelled nominal -> run."""

import json

import pytest

from jaxinfer.runtime.config import ModelConfig
from jaxinfer.tools import bench_device
from jaxinfer.tools.bench_device import (DEEPSEEK_V3, GEMMA3_4B_VISION, GEMMA4_26B_A4B,
                                         GPT_OSS_20B, LLAMA3_8B, QWEN3_30B_A3B, TINY_DEEPSEEK_V3,
                                         TINY_GEMMA4, TINY_VISION, Shapes, chip_peak, is_oom,
                                         kernel_cases, layer_kv, layouts, main, make_case,
                                         markdown, vision_flops, vision_modes)
from jaxinfer.tools.engine_runs import workload


def test_smoke_runs_every_section_and_writes_both_reports(tmp_path):
    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "device.json").read_text())
    secs = data["sections"]
    assert list(secs) == ["env", "kernels", "bandwidth", "engine", "moe", "deepseek_v3",
                          "gpt_oss", "gemma4", "vision"]
    assert not any("error" in s for s in secs.values()) and secs["env"]["shapes"] == "smoke"
    kern = secs["kernels"]["rows"]
    assert len(kern) == 8 and all(r["ok"] and r["max_err"] < 0.03 for r in kern)
    assert {r["layout"] for r in kern} == {"decode", "prefill", "verify", "mixed"}
    assert any(r["int8"] and r["nan_fill"] for r in kern) and any(r["window"] for r in kern)
    assert not any("shape" in r for s in secs.values() for r in s["rows"])  # nothing scaled
    bw = secs["bandwidth"]
    assert bw["copy_bandwidth_gbs"] > 0 and all(r["kernel_gbs"] > 0 for r in bw["rows"])
    eng = [r for r in secs["engine"]["rows"] if r["batch"] != "mixed"]
    steady = [r for r in eng if r["run"] == "steady"]
    assert {r["batch"] for r in steady} == {1, 4} and any("int8" in r["weights"] for r in steady)
    assert any("int4" in r["weights"] for r in steady)
    assert all(r["compiles"] == 0 and r["decode_tok_s"] > 0 for r in steady)
    # the mixed workload, continuously batched and in static batches: every token both ways
    mixed = [r for r in secs["engine"]["rows"] if r["batch"] == "mixed"]
    assert [r["run"] for r in mixed] == ["first", "steady"]
    m = Shapes("smoke").mixed
    want = sum(o for _, o in workload(m["requests"], 512, m["prompt"], m["output"], 0, {0}))
    for r in mixed:
        assert "error" not in r and r["output_tokens"] == want
        assert r["continuous_tok_s"] > 0 and r["static_tok_s"] > 0
        assert r["continuous_vs_static"] == pytest.approx(r["continuous_tok_s"]
                                                          / r["static_tok_s"])
        # static batches wait for their longest request: more steps for the same tokens
        assert r["continuous_steps"] < r["static_steps"]
    assert mixed[1]["compiles"] == 0
    assert "slots: continuous batching against static batches of 4" in secs["engine"][
        "mixed_workload"]
    moe = [r for r in secs["moe"]["rows"] if r["run"] == "steady"]
    assert {(r["batch"], r["weights"][:4]) for r in moe} == {(1, "floa"), (4, "floa"), (1, "int8")}
    assert all(r["compiles"] == 0 and r["decode_tok_s"] > 0 for r in moe)
    for name in ("deepseek_v3", "gpt_oss", "gemma4"):
        rows = secs[name]["rows"]
        assert not any("error" in r for r in rows)
        steady = [r for r in rows if r.get("run") == "steady"]
        assert {r["batch"] for r in steady} == {1, 4}
        assert all(r["compiles"] == 0 and r["decode_tok_s"] > 0 for r in steady)
    # the latent cache: per token and layer one head of C + R = 48 + 16 (f32), standing for
    # H = 4 heads of K (N + R = 16 + 16) and V (16): (4 * 32 + 4 * 16) / 64 = 3
    tiny = TINY_DEEPSEEK_V3
    assert (tiny["num_heads"], tiny["kv_lora_rank"], tiny["qk_nope_head_dim"],
            tiny["qk_rope_head_dim"], tiny["v_head_dim"], tiny["num_layers"]) == (
        4, 48, 16, 16, 16, 2)
    [kv] = [r for r in secs["deepseek_v3"]["rows"] if r["batch"] == "kv"]
    assert kv["kv_compression"] == pytest.approx((4 * (16 + 16) + 4 * 16) / (48 + 16)) == 3
    assert kv["kv_bytes_per_token"] == 2 * (48 + 16) * 4
    assert kv["expanded_kv_bytes_per_token"] == 2 * 4 * (16 + 16 + 16) * 4
    # Gemma 4's pools by layer type (f32): the sliding layer's K and V of 4 heads x 16, the
    # global layer's of 1 head x 32 (V = K's projection, cached apart)
    tiny = TINY_GEMMA4
    assert (tiny["num_kv_heads"], tiny["head_dim"], tiny["global_kv_heads"],
            tiny["global_head_dim"], tiny["layer_types"]) == (4, 16, 1, 32, ("local", "global"))
    [kv] = [r for r in secs["gemma4"]["rows"] if r["batch"] == "kv"]
    assert {k: kv[k] for k in ("local_layers", "local_kv_bytes_per_token", "global_layers",
                               "global_kv_bytes_per_token", "kv_shared_layers",
                               "kv_bytes_per_token")} == dict(
        local_layers=1, local_kv_bytes_per_token=2 * 4 * 16 * 4, global_layers=1,
        global_kv_bytes_per_token=2 * 1 * 32 * 4, kv_shared_layers=0,
        kv_bytes_per_token=512 + 256)
    # the vision encoder at batch 1 and 2, one call each (the engine's calls take up to 4):
    # T = 8 x 8 patches of 4 x 4 x 3, width 32, MLP 64, 2 layers, 16 tokens of 64
    vis = secs["vision"]
    tiny = 2 * 64 * 48 * 32 + 2 * (4 * 2 * 64 * 32 * 32 + 2 * 2 * 64 * 64 * 32
                                   + 2 * 2 * 64 * 32 * 64) + 2 * 16 * 32 * 64
    assert vis["gflops_per_image"] * 1e9 == pytest.approx(tiny) and tiny == 3_407_872
    assert vis["max_images_per_call"] == 4 and "peak_bf16_tflop_s" not in vis  # CPU
    rows = vis["rows"]
    assert [(r["batch"], r["mode"], r["run"]) for r in rows] == [
        (b, f"engine: 1 call of {b}", run) for b in (1, 2) for run in ("first", "steady")]
    for r in rows:
        assert r["calls"] == 1 and r["images_per_s"] > 0 and "error" not in r
        assert r["ms"] == pytest.approx(r["ms_per_call"])
        assert r["images_per_s"] == pytest.approx(r["batch"] / r["ms"] * 1e3)
        if r["run"] == "first":
            assert 0 < r["compile_s"] < r["ms"] / 1e3 and "tflop_s" not in r
        else:
            assert r["tflop_s"] == pytest.approx(r["batch"] * tiny / r["ms"] / 1e9)
    md = (tmp_path / "device.md").read_text()
    assert "## vision" in md and "| batch | mode | calls | run | ms | ms_per_call |" in md
    assert md == markdown(data) and "| layout | page_size | head_dim |" in md
    assert "## kernels" in md and "passed: 8/8" in md and "continuous_vs_static" in md


def test_cpu_scale_keeps_every_full_case_and_divides_the_dimensions():
    full, s = Shapes(), Shapes("scaled", 16)
    assert s.kernel_cases() == kernel_cases(False) and len(s.kernel_cases()) == 40
    lays, nominal = s.layouts(), layouts(False)
    assert full.layouts() == nominal and set(lays) == set(nominal)
    assert lays["prefill"] == ([16, 4], [64, 4])  # queries over 16 and KV lengths / 16, rounded up
    assert lays["decode"] == ([1] * 8, [2, 19, 64, 1, 4, 49, 8, 33])
    assert lays["verify"] == ([5] * 6, [5, 19, 5, 63, 5, 9])  # verify queries kept, KV >= them
    assert lays["mixed"] == ([1, 1, 8, 5, 1], [57, 3, 24, 5, 1])
    assert (s.kernel_kv_heads, full.kernel_kv_heads) == (1, 2)
    grid = s.bandwidth_grid()
    assert [(b, c) for b, c, _ in grid] == [(b, c) for b in (64, 256) for c in (2048, 8192, 32768)]
    assert [r for *_, r in grid] == [128, 512, 2048] * 2
    assert [r for *_, r in full.bandwidth_grid()] == [c for _, c, _ in grid]
    assert s.bandwidth_heads == (1, 128) and full.bandwidth_heads == (8, 128)
    assert full.model(LLAMA3_8B, {}) == LLAMA3_8B
    llama = s.model(LLAMA3_8B, {})
    assert {k: llama[k] for k in ("num_layers", "hidden_size", "intermediate_size", "num_heads",
                                  "num_kv_heads", "head_dim", "vocab_size")} == dict(
        num_layers=2, hidden_size=256, intermediate_size=896, num_heads=4, num_kv_heads=1,
        head_dim=128, vocab_size=8016)
    moe = s.model(QWEN3_30B_A3B, {})
    assert (moe["num_layers"], moe["hidden_size"], moe["moe_intermediate_size"],
            moe["num_experts"], moe["experts_per_token"]) == (1, 128, 48, 128, 8)
    # latent attention: one KV head, query heads and latent widths divided, head_dim C + R;
    # the dense first layer and the MoE layer apart
    ds = s.model(DEEPSEEK_V3, {})
    ModelConfig(family="llama", **ds)
    assert {k: ds[k] for k in ("num_layers", "dense_layers", "num_heads", "num_kv_heads",
                               "kv_lora_rank", "q_lora_rank", "head_dim", "qk_rope_head_dim",
                               "hidden_size", "intermediate_size", "moe_intermediate_size",
                               "shared_expert_size", "num_experts", "router_groups")} == dict(
        num_layers=2, dense_layers=(0,), num_heads=8, num_kv_heads=1, kv_lora_rank=32,
        q_lora_rank=96, head_dim=32 + 64, qk_rope_head_dim=64, hidden_size=448,
        intermediate_size=1152, moe_intermediate_size=128, shared_expert_size=128,
        num_experts=256, router_groups=8)
    # a sliding and a full layer kept, the window divided
    oss = s.model(GPT_OSS_20B, {})
    ModelConfig(family="llama", **oss)
    assert (oss["num_layers"], oss["layer_types"], oss["sliding_window"], oss["num_heads"],
            oss["num_kv_heads"], oss["head_dim"], oss["moe_intermediate_size"]) == (
        2, ("local", "global"), 8, 8, 1, 64, 180)
    # Gemma 4: five sliding layers and the global one kept; the global layers' KV heads
    # divided, their head_dim kept
    g4 = s.model(GEMMA4_26B_A4B, {})
    ModelConfig(**g4)
    assert {k: g4[k] for k in ("num_layers", "layer_types", "num_heads", "num_kv_heads",
                               "head_dim", "global_kv_heads", "global_head_dim", "hidden_size",
                               "intermediate_size", "moe_intermediate_size", "sliding_window",
                               "vocab_size")} == dict(
        num_layers=6, layer_types=("local",) * 5 + ("global",), num_heads=2, num_kv_heads=1,
        head_dim=256, global_kv_heads=1, global_head_dim=512, hidden_size=176,
        intermediate_size=132, moe_intermediate_size=44, sliding_window=64, vocab_size=16384)
    # at 1/4: 2 KV heads, 4 query heads; the global layers' 2 KV heads / 4 rounded down to 1
    g4 = Shapes("scaled", 4).model(GEMMA4_26B_A4B, {})
    assert (g4["num_heads"], g4["num_kv_heads"], g4["global_kv_heads"]) == (4, 2, 1)
    assert full.model(DEEPSEEK_V3, {}) == DEEPSEEK_V3
    assert s.batches("deepseek_v3") == s.batches("gpt_oss") == s.batches("gemma4") == (1, 64)
    assert s.batches("engine") == full.batches("engine") == (1, 64, 256)
    assert s.batches("moe") == full.batches("moe") == (1, 64)
    assert (s.decode_lens, full.decode_lens) == ((8, 8), (128, 64))
    assert s.mixed == dict(requests=256, slots=64, prompt=(1, 16), output=(1, 8))
    assert full.mixed == dict(requests=256, slots=64, prompt=(16, 256), output=(8, 128))
    assert s.tag("a", "b") == {"shape": "a -> b"} and full.tag("a", "b") == {}
    # the vision encoder: heads kept (hidden rounded up to a multiple of them), widths divided,
    # layers down; patch 14 and the 4 x 4 pool kept, the 16 tokens a side divided (up)
    from jaxinfer.runtime.device.vision import VisionConfig

    assert full.vision(GEMMA3_4B_VISION, {}) == GEMMA3_4B_VISION
    keys = ("num_layers", "hidden_size", "num_heads", "intermediate_size", "image_size",
            "patch_size", "tokens_per_image", "text_hidden_size")
    for div, want in ((16, (1, 80, 16, 269, 56, 14, 1, 160)),
                      (4, (6, 288, 16, 1076, 224, 14, 16, 640)),
                      (64, (1, 32, 16, 68, 56, 14, 1, 40))):
        v = Shapes("scaled", div).vision(GEMMA3_4B_VISION, {})
        assert tuple(v[k] for k in keys) == want
        assert VisionConfig(**v).pool == 4
    assert s.vision_batches == full.vision_batches == (1, 16)
    assert Shapes("smoke").vision({}, TINY_VISION) == TINY_VISION
    assert "1/16" in s.describe() and "not the nominal" in s.describe()


def test_cpu_scale_run_labels_every_row_nominal_and_run(tmp_path, monkeypatch):
    # cut down: two of the full kernel cases (the last: int8, window, NaN), one grid point; 1/64
    full = kernel_cases(False)
    cases = [c for c in full if c["window"] and c["layout"] == "prefill"] + full[-1:]
    monkeypatch.setattr(Shapes, "kernel_cases", lambda self: cases)
    grid = Shapes.bandwidth_grid  # of the real grid, its longest context at batch 64
    monkeypatch.setattr(Shapes, "bandwidth_grid",
                        lambda self: [p for p in grid(self) if p[0] == 64][-1:])
    assert main(["--cpu-scale", "64", "--sections", "kernels,bandwidth",
                 "--out", str(tmp_path)]) == 0
    secs = json.loads((tmp_path / "device.json").read_text())["sections"]
    assert secs["env"]["shapes"].startswith("scaled 1/64")
    kern = secs["kernels"]["rows"]
    assert len(kern) == 2 and all(r["ok"] for r in kern) and kern[1]["int8"]
    assert secs["kernels"]["interpret"] is True
    assert kern[0]["shape"] == "q 256,64 kv 1024,64 Hkv 2 -> q 4,1 kv 16,1 Hkv 1"  # prefill
    bw = secs["bandwidth"]["rows"]
    assert [r["shape"] for r in bw] == ["b64 ctx 32768 Hkv 8 -> b64 ctx 512 Hkv 1"]
    assert all(r["kernel_gbs"] > 0 and r["xla_gbs"] > 0 for r in bw)
    assert "| layout | shape |" in (tmp_path / "device.md").read_text()


def test_cpu_scale_is_refused_on_an_accelerator_and_with_smoke(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit):
        main(["--smoke", "--cpu-scale", "16", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        main(["--cpu-scale", "0", "--out", str(tmp_path)])
    import jax  # bench_device imports it where it runs

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert main(["--cpu-scale", "16", "--out", str(tmp_path / "r")]) == 2
    assert "--cpu-scale is for CPU runs" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_layer_kv_counts_each_type_once_and_nothing_for_the_shared_layers():
    import jax.numpy as jnp

    from jaxinfer.runtime.device.kv_cache import init_cache

    # 2 sliding and 2 global layers, the last two reading layers 0 and 1's KV
    cfg = ModelConfig(**dict(TINY_GEMMA4, num_layers=4, layer_types=("local", "global") * 2,
                             kv_shared_layers=2, double_wide_shared_mlp=True))
    kv = layer_kv(init_cache(cfg, 5, 16, jnp.bfloat16), cfg)
    assert kv == dict(local_layers=1, local_kv_bytes_per_token=2 * 4 * 16 * 2, global_layers=1,
                      global_kv_bytes_per_token=2 * 1 * 32 * 2, kv_shared_layers=2,
                      kv_bytes_per_token=256 + 128)


def test_nan_fill_poisons_exactly_the_slots_no_valid_position_reads():
    import numpy as np

    args, _ = make_case([1, 3], [5, 18], num_kv_heads=1, gqa=1, head_dim=8, page_size=8,
                        dtype=np.float32, nan_fill=True)
    k, table = np.asarray(args[1])[0], np.asarray(args[4])  # [N, ps, D], [S, P]
    live = np.zeros(k.shape[:2], bool)
    for s, kv in enumerate([5, 18]):
        for j in range(kv):
            live[table[s, j // 8], j % 8] = True
    assert live.sum() == 23 and k.shape[0] == 1 + 1 + 3 + 2  # null page + pages + 2 spare
    assert np.isfinite(k[live]).all() and np.isnan(k[~live]).all()


def test_vision_flops_of_the_full_shape_by_hand():
    # T = (896 / 14)^2 = 4096 patches of 14 x 14 x 3 = 588 values, width 1152 (16 heads of 72),
    # MLP 4304, 27 layers, 256 soft tokens of 2560; 2 FLOPs a multiply-add
    patch = 2 * 4096 * 588 * 1152  # patch embedding
    qkvo = 4 * 2 * 4096 * 1152 * 1152  # q, k, v, o projections
    attn = 2 * (2 * 16 * 4096 * 4096 * 72)  # q . k scores and their weighted sum of v
    mlp = 2 * (2 * 4096 * 1152 * 4304)  # fc1, fc2
    proj = 2 * 256 * 1152 * 2560  # the projector, after the 4 x 4 pool
    assert (patch, qkvo, attn, mlp, proj) == (5_549_064_192, 43_486_543_872, 77_309_411_328,
                                              81_235_279_872, 1_509_949_440)
    total = patch + 27 * (qkvo + attn + mlp) + proj
    assert vision_flops(GEMMA3_4B_VISION) == total == 5_461_902_360_576  # 5.46 TFLOP an image


def test_vision_modes_peaks_and_oom():
    assert vision_modes(16, 4) == [("engine: 4 calls of 4", 4), ("one call of 16", 16)]
    assert vision_modes(1, 4) == [("engine: 1 call of 1", 1)]
    assert vision_modes(2, 1) == [("engine: 2 calls of 1", 1), ("one call of 2", 2)]
    assert chip_peak("NVIDIA H100 80GB HBM3") == ("H100 SXM", 989e12)
    assert chip_peak("NVIDIA H200") == ("H200 SXM", 989e12)
    assert chip_peak("TPU v5 lite")[0] == "TPU v5e" and chip_peak("TPU v6 lite")[0] == "TPU v6e"
    assert chip_peak("NVIDIA H100 PCIe") is None and chip_peak("cpu") is None
    assert is_oom(RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17 GiB"))
    assert is_oom(MemoryError("CUDA out of memory")) and not is_oom(ValueError("bad shape"))


def test_vision_runs_as_the_engine_calls_and_notes_an_oom(tmp_path, monkeypatch):
    # one image a call: batch 2 in 2 calls of 1, then as one call of 2, whose allocation fails
    import jaxinfer.runtime.images as images

    monkeypatch.setattr(images, "MAX_IMAGES_PER_CALL", 1)
    runs = bench_device._vision_runs
    calls = []

    def fake(fn, params, pixels, per_call, repeats):
        calls.append((pixels.shape[0], per_call))
        if per_call > 1:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
                               "17.18GiB.\nmore")
        return runs(fn, params, pixels, per_call, repeats)

    monkeypatch.setattr(bench_device, "_vision_runs", fake)
    assert main(["--smoke", "--sections", "vision", "--out", str(tmp_path)]) == 0
    assert calls == [(1, 1), (2, 1), (2, 2)]
    secs = json.loads((tmp_path / "device.json").read_text())["sections"]
    assert list(secs) == ["env", "vision"] and "error" not in secs["vision"]
    rows = secs["vision"]["rows"]
    assert [(r["batch"], r["mode"], r.get("run")) for r in rows] == [
        (1, "engine: 1 call of 1", "first"), (1, "engine: 1 call of 1", "steady"),
        (2, "engine: 2 calls of 1", "first"), (2, "engine: 2 calls of 1", "steady"),
        (2, "one call of 2", None)]
    assert rows[3]["calls"] == 2 and rows[3]["ms_per_call"] == pytest.approx(rows[3]["ms"] / 2)
    assert rows[4]["note"] == ("out of memory: RESOURCE_EXHAUSTED: Out of memory while trying "
                               "to allocate 17.18GiB.") and "error" not in rows[4]
