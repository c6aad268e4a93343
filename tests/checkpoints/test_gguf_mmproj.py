"""llama.cpp's mmproj GGUF (the vision tower + projector beside a GGUF text model) loaded by
checkpoints/gguf_vision.py, against HF transformers on the tiny random Gemma 3 of
tests/vision_models.py: the file is written here the way llama.cpp's converter writes it
(`write_mmproj`), loaded, and its soft tokens held against Gemma3Model.get_image_features; the
refusals name the file; the `mmproj` engine option attaches it to a text-only Gemma 3 (whose
engine then runs images as the HF vision-language model does) and refuses it elsewhere.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT
from gguf import LlamaFileType as FT

from jaxinfer.checkpoints.errors import CheckpointError
from jaxinfer.checkpoints.gguf_vision import load_gguf_mmproj
from jaxinfer.runtime.config import OptionError
from jaxinfer.runtime.device.vision import encode_images
from tests import vision_models as vm

IDS = {"image": vm.IMAGE_TOKEN_ID, "boi": vm.BOI_TOKEN_ID, "eoi": vm.EOI_TOKEN_ID}
encode = jax.jit(encode_images, static_argnums=2)

# --------------------------------------------------------------------------- the converter
# Mirrors llama.cpp's convert_hf_to_gguf.py (upstream now conversion/base.py + conversion/gemma.py;
# read, not copied):
#  - MmprojModel.set_gguf_parameters: general.type "mmproj", general.file_type,
#    clip.has_vision_encoder, clip.vision.projection_dim = the text model's hidden_size,
#    image_size, patch_size, embedding_length, feed_forward_length, block_count,
#    attention.head_count, image_mean / image_std (the preprocessor config's);
#  - Gemma3VisionModel.set_gguf_parameters: clip.projector_type "gemma3",
#    attention.layer_norm_epsilon, clip.use_gelu true, and clip.vision.projector.scale_factor =
#    (image_size // patch_size) // sqrt(image_seq_length) only when it is not 4;
#  - Gemma3VisionModel.filter_tensors: only multi_modal_projector. / vision_tower. tensors,
#    "_weight" -> ".weight" (mm_input_projection_weight -> mm_input_projection.weight);
#  - Gemma3VisionModel.modify_tensors: soft_emb_norm.weight + 1, then ModelBase.modify_tensors:
#    the name mapped by gguf's TensorNameMap (map_tensor_name), the data unchanged (torch's
#    shape: [out, in] linears, the [Dv, 3, P, P] conv, the [Dv, D] projection as HF has it);
#  - ModelBase.prepare_tensors with Gemma3VisionModel / MmprojModel.tensor_force_quant: the
#    projection F16 whatever the output type, ".embeddings." tensors F32, 1-D tensors and
#    "_norm.weight" F32, v.position_embd and non-".weight" tensors F32, the rest the output type.
FTYPES = {"f32": FT.ALL_F32, "f16": FT.MOSTLY_F16, "bf16": FT.MOSTLY_BF16, "q8_0": FT.MOSTLY_Q8_0}
_FTYPE_QT = {FT.ALL_F32: QT.F32, FT.MOSTLY_F16: QT.F16, FT.MOSTLY_BF16: QT.BF16,
             FT.MOSTLY_Q8_0: QT.Q8_0}


def _hub_name(name: str) -> str:
    """An HF Gemma 3 tensor name as the hub's checkpoints spell it (the converter's tensor map
    knows "vision_tower.vision_model..."; transformers 5 saves "vision_tower.encoder...")."""
    name = re.sub(r"^model\.", "", name)
    if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
        name = "vision_tower.vision_model." + name[len("vision_tower."):]
    return name


def _qtype(hf_name: str, new_name: str, ndim: int, ftype: FT):
    force = False
    if "input_projection" in hf_name:
        force = QT.F16
    elif ".embeddings." in hf_name:
        force = QT.F32
    elif ".patch_embd.weight" in new_name:
        force = QT.F16 if ftype == FT.MOSTLY_F16 else QT.F32
    if ndim <= 1 or new_name.endswith("_norm.weight"):
        force = QT.F32
    if force is False and (new_name == "v.position_embd.weight"
                           or not new_name.endswith(".weight")):
        force = QT.F32
    return _FTYPE_QT[ftype] if force is False else force


def write_mmproj(hf, path: Path, ftype: str = "f32", *, image_seq_length=vm.MM_TOKENS_PER_IMAGE,
                 meta: dict | None = None, drop=(), replace: dict | None = None,
                 proj_qtype=None) -> Path:
    """`hf`'s vision tower + projector as llama.cpp's converter writes its mmproj GGUF.
    `image_seq_length`: the processor config's (a real checkpoint's processor_config.json has
    it; without it the converter assumes 256). Test knobs: `meta` {key: value (None: left out)},
    `drop` tensor names, `replace` {name: numpy array as stored}, `proj_qtype` (the projection
    in another type than the converter's F16)."""
    vc, ft = hf.config.vision_config, FTYPES[ftype]
    kv = {
        "general.type": ("mmproj", VT.STRING),
        "general.name": ("tiny-gemma3-vision", VT.STRING),
        "general.file_type": (int(ft), VT.UINT32),
        "clip.has_vision_encoder": (True, VT.BOOL),
        "clip.vision.projection_dim": (hf.config.text_config.hidden_size, VT.UINT32),
        "clip.vision.image_size": (vc.image_size, VT.UINT32),
        "clip.vision.patch_size": (vc.patch_size, VT.UINT32),
        "clip.vision.embedding_length": (vc.hidden_size, VT.UINT32),
        "clip.vision.feed_forward_length": (vc.intermediate_size, VT.UINT32),
        "clip.vision.block_count": (vc.num_hidden_layers, VT.UINT32),
        "clip.vision.attention.head_count": (vc.num_attention_heads, VT.UINT32),
        "clip.vision.image_mean": (list(vm.IMAGE_MEAN), VT.ARRAY),
        "clip.vision.image_std": (list(vm.IMAGE_STD), VT.ARRAY),
        "clip.projector_type": ("gemma3", VT.STRING),
        "clip.vision.attention.layer_norm_epsilon": (vc.layer_norm_eps, VT.FLOAT32),
        "clip.use_gelu": (True, VT.BOOL),
    }
    scale = (vc.image_size // vc.patch_size) // int(image_seq_length ** 0.5)
    if scale > 0 and scale != 4:
        kv["clip.vision.projector.scale_factor"] = (scale, VT.UINT32)
    for k, v in (meta or {}).items():
        if v is None:
            kv.pop(k, None)
        else:
            kv[k] = (v, kv[k][1] if k in kv else VT.STRING)
    w = gguf.GGUFWriter(str(path), "clip")
    for k, (v, t) in kv.items():
        w.add_key_value(k, v, t, sub_type=VT.FLOAT32 if t == VT.ARRAY else None)
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vc.num_hidden_layers)
    for name, p in hf.state_dict().items():
        name = _hub_name(name)
        if "vision_model.head." in name or not name.startswith(
                ("multi_modal_projector.", "vision_tower.")):
            continue
        name = name.replace("_weight", ".weight")
        data = p.detach().float().numpy()
        if "soft_emb_norm.weight" in name:
            data = data + 1
        new = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        if new in drop:
            continue
        data = (replace or {}).get(new, data)
        qt = _qtype(name, new, data.ndim, ft)
        if proj_qtype is not None and new == "mm.input_projection.weight":
            qt = proj_qtype
        w.add_tensor(new, gguf.quants.quantize(np.ascontiguousarray(data), qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def hf(gemma3_vision_dir):
    return gemma3_vision_dir[1]


@pytest.fixture(scope="module")
def hf_f16_proj(hf):
    """`hf` with its projection rounded to f16: the model an f32 mmproj file holds (the
    converter keeps the projection F16 whatever the output type)."""
    m = copy.deepcopy(hf)
    with torch.no_grad():
        p = m.model.multi_modal_projector.mm_input_projection_weight
        p.copy_(p.half().float())
    return m


@pytest.fixture(scope="module")
def files(hf, tmp_path_factory):
    d = tmp_path_factory.mktemp("mmproj")
    return {ft: write_mmproj(hf, d / f"mmproj-{ft}.gguf", ft) for ft in FTYPES}


def hf_image_features(model, pixels: np.ndarray) -> np.ndarray:  # [N, S, S, 3] -> [N, t, D]
    with torch.no_grad():
        out = model.model.get_image_features(torch.from_numpy(pixels).permute(0, 3, 1, 2))
    return out.pooler_output.numpy()


def random_pixels(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (n, vm.IMAGE_SIZE, vm.IMAGE_SIZE, 3)
                                               ).astype(np.float32)


# --------------------------------------------------------------------------- loading


def test_the_file_is_laid_out_as_the_converter_writes_it(files):
    from jaxinfer.checkpoints.gguf import open_gguf

    r = open_gguf(files["f16"])
    types = {t.name: t.tensor_type for t in r.tensors}
    ne = {t.name: t.shape.tolist() for t in r.tensors}
    assert r.fields["general.architecture"].contents() == "clip"
    assert r.fields["clip.vision.projector.scale_factor"].contents() == 2  # 8 patches -> 4
    assert types["mm.input_projection.weight"] == QT.F16
    assert ne["mm.input_projection.weight"] == [vm.TEXT_HIDDEN, vm.VISION_HIDDEN]  # [D, Dv]
    assert types["v.patch_embd.weight"] == types["v.position_embd.weight"] == QT.F32
    assert ne["v.patch_embd.weight"] == [vm.PATCH_SIZE, vm.PATCH_SIZE, 3, vm.VISION_HIDDEN]
    assert types["v.blk.0.attn_q.weight"] == types["v.blk.1.ffn_down.weight"] == QT.F16
    assert types["v.blk.0.attn_q.bias"] == types["mm.soft_emb_norm.weight"] == QT.F32
    assert len(types) == 7 + 16 * vm.VISION_LAYERS


def test_config_from_the_file(files):
    cfg = load_gguf_mmproj(files["f32"], IDS).cfg
    assert (cfg.image_token_id, cfg.boi_token_id, cfg.eoi_token_id) == (
        vm.IMAGE_TOKEN_ID, vm.BOI_TOKEN_ID, vm.EOI_TOKEN_ID)
    assert cfg.tokens_per_image == vm.MM_TOKENS_PER_IMAGE and cfg.pool == 2
    assert (cfg.image_size, cfg.patch_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads,
            cfg.intermediate_size) == (vm.IMAGE_SIZE, vm.PATCH_SIZE, vm.VISION_HIDDEN,
                                       vm.VISION_LAYERS, vm.VISION_HEADS, vm.VISION_INTERMEDIATE)
    assert cfg.text_hidden_size == vm.TEXT_HIDDEN and cfg.layer_norm_eps == 1e-6
    assert cfg.mm_norm_eps == 1e-6 and cfg.image_mean == vm.IMAGE_MEAN
    assert cfg.image_std == vm.IMAGE_STD
    hash(cfg)  # a static jit argument


def test_without_a_scale_factor_gemma3_pools_by_4(hf, tmp_path):
    """clip.cpp's fixed n_merge 4: 8 patches a side -> 2 x 2 = 4 tokens (the converter leaves
    the key out for 4: Gemma 3's 64 patches a side -> 256 tokens)."""
    f = write_mmproj(hf, tmp_path / "m.gguf", image_seq_length=4)
    assert load_gguf_mmproj(f, IDS).cfg.tokens_per_image == 4


@pytest.mark.parametrize("n", [1, 2])
def test_f32_file_matches_hf(files, hf, hf_f16_proj, n):
    """Exact up to f32 rounding against the model the file holds (HF's with its projection in
    f16, as the converter stores it); close to HF's own."""
    model = load_gguf_mmproj(files["f32"], IDS)
    x = random_pixels(n, seed=n)
    ours = np.asarray(encode(model.params, jnp.asarray(x), model.cfg))
    ref = hf_image_features(hf_f16_proj, x)
    assert ours.shape == (n, vm.MM_TOKENS_PER_IMAGE, vm.TEXT_HIDDEN) and ours.dtype == np.float32
    assert np.abs(ref).max() > 0.5  # not a degenerate oracle
    assert np.abs(ours - ref).max() <= 1e-4
    assert np.abs(ours - hf_image_features(hf, x)).max() <= 3e-3


def test_f32_projection_matches_hf_exactly(hf, tmp_path):
    model = load_gguf_mmproj(write_mmproj(hf, tmp_path / "m.gguf", proj_qtype=QT.F32), IDS)
    x = random_pixels(2, seed=7)
    ours = np.asarray(encode(model.params, jnp.asarray(x), model.cfg))
    assert np.abs(ours - hf_image_features(hf, x)).max() <= 1e-4


@pytest.mark.parametrize("ftype,tol", [("f16", 2e-3), ("bf16", 1e-2), ("q8_0", 2e-2)])
def test_half_and_quantized_files_close_to_hf(files, hf, ftype, tol):
    model = load_gguf_mmproj(files[ftype], IDS)
    x = random_pixels(2, seed=5)
    ours = np.asarray(encode(model.params, jnp.asarray(x), model.cfg))
    ref = hf_image_features(hf, x)
    err = np.abs(ours - ref).max()
    assert err <= tol * np.abs(ref).max(), err


def test_loads_in_the_compute_dtype(files):
    model = load_gguf_mmproj(files["f16"], IDS, dtype=jnp.bfloat16)
    leaves = jax.tree_util.tree_leaves(model.params)
    assert {a.dtype for a in leaves} == {jnp.dtype(jnp.bfloat16)}


# --------------------------------------------------------------------------- refusals


def _refused(path, *words, ids=IDS):
    with pytest.raises(CheckpointError) as e:
        load_gguf_mmproj(path, ids)
    msg = str(e.value)
    assert str(path) in msg, msg
    for w in words:
        assert w in msg, msg
    return msg


def test_not_a_gguf_file(tmp_path):
    f = tmp_path / "mmproj.gguf"
    f.write_text("not a model")
    _refused(f, "not a GGUF file")
    _refused(tmp_path / "absent.gguf", "not found")


def test_a_text_model_gguf_has_no_clip_metadata(tmp_path):
    f = tmp_path / "text.gguf"
    w = gguf.GGUFWriter(str(f), "gemma3")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _refused(f, "no clip metadata", "'gemma3'")


def test_another_projector_type_names_the_supported_ones(hf, tmp_path):
    f = write_mmproj(hf, tmp_path / "m.gguf", meta={"clip.projector_type": "idefics3"})
    _refused(f, "'idefics3'", "supported: gemma3")


def test_no_vision_encoder(hf, tmp_path):
    f = write_mmproj(hf, tmp_path / "m.gguf", meta={"clip.has_vision_encoder": None})
    _refused(f, "no vision encoder")


@pytest.mark.parametrize("gone", ["v.blk.1.ffn_down.weight", "mm.soft_emb_norm.weight",
                                  "mm.input_projection.weight"])
def test_missing_tensor_is_named(hf, tmp_path, gone):
    _refused(write_mmproj(hf, tmp_path / "m.gguf", drop=(gone,)), gone)


def test_missing_key_is_named(hf, tmp_path):
    key = "clip.vision.attention.layer_norm_epsilon"
    _refused(write_mmproj(hf, tmp_path / "m.gguf", meta={key: None}), key)


@pytest.mark.parametrize("meta,replace,words", [
    ({"clip.vision.feed_forward_length": 48}, None, ["'v.blk.0.ffn_up.weight'", "(48, 32)"]),
    (None, {"v.position_embd.weight": np.zeros((60, vm.VISION_HIDDEN), np.float32)},
     ["'v.position_embd.weight'", "(60, 32)", "(64, 32)"]),
    ({"clip.vision.embedding_length": 48}, None, ["shape"]),
    ({"clip.vision.attention.head_count": 5}, None, ["not a multiple of num_heads"]),
    ({"clip.vision.block_count": 1}, None, ["unexpected", "v.blk.1."]),
])
def test_shapes_disagreeing_with_the_metadata(hf, tmp_path, meta, replace, words):
    _refused(write_mmproj(hf, tmp_path / "m.gguf", meta=meta, replace=replace), *words)


# --------------------------------------------------------------------------- the engine option


@pytest.fixture(scope="module")
def text_dir(hf, tmp_path_factory):
    """The tiny Gemma 3's text side alone as an HF Gemma3ForCausalLM dir (the weights of `hf`'s
    language model), with the byte tokenizer that knows Gemma's image tokens: what a GGUF text
    model + its mmproj file hold between them."""
    import transformers

    from tests.byte_tokenizer import GEMMA3_VISION_TEMPLATE, write_byte_tokenizer

    out = tmp_path_factory.mktemp("gemma3_text")
    text = transformers.Gemma3ForCausalLM(hf.config.text_config).eval()
    text.model.load_state_dict(hf.model.language_model.state_dict())
    with torch.no_grad():
        text.lm_head.weight.copy_(hf.lm_head.weight)
    text.save_pretrained(out, safe_serialization=True)
    write_byte_tokenizer(out, vm.SPECIALS, vm.VOCAB, GEMMA3_VISION_TEMPLATE)
    return out


def _load(model, **options):
    from jaxinfer.runtime.build import load

    return load(str(model), dict(tensor_parallel=1, **options))


def test_option_refused_for_a_model_with_a_tower(gemma3_vision_dir, files):
    with pytest.raises(OptionError) as e:
        _load(gemma3_vision_dir[0], mmproj=str(files["f32"]))
    assert e.value.option == "mmproj" and "vision tower of its own" in str(e.value)


def test_option_refused_for_a_model_not_gemma3(tiny_dir, files):
    with pytest.raises(OptionError) as e:
        _load(tiny_dir, mmproj=str(files["f32"]))
    assert e.value.option == "mmproj" and "Gemma 3" in str(e.value)


def test_option_refused_when_the_tokenizer_lacks_the_image_tokens(text_dir, files, tmp_path):
    import shutil

    from tests.byte_tokenizer import write_byte_tokenizer

    d = tmp_path / "no_image_tokens"
    shutil.copytree(text_dir, d)
    specials = {k: v for k, v in vm.SPECIALS.items() if k != "<image_soft_token>"}
    write_byte_tokenizer(d, specials, vm.VOCAB)
    with pytest.raises(OptionError) as e:
        _load(d, mmproj=str(files["f32"]))
    assert e.value.option == "mmproj" and "<image_soft_token>" in str(e.value)


def test_option_refused_for_a_text_model_of_another_width(tmp_path, files):
    from tests.gemma_fixtures import tiny_gemma3_hf

    d = tmp_path / "wide"
    tiny_gemma3_hf(d, vocab=vm.VOCAB, hidden_size=96)
    from tests.byte_tokenizer import write_byte_tokenizer

    write_byte_tokenizer(d, vm.SPECIALS, vm.VOCAB)
    with pytest.raises(OptionError) as e:
        _load(d, mmproj=str(files["f32"]))
    assert e.value.option == "mmproj" and "96" in str(e.value) and "64" in str(e.value)


def test_a_gguf_text_model_without_the_image_token(gemma_gguf_path, files):
    """The real Gemma 3 270M GGUF (text only: its 262144-token vocabulary ends before
    <image_soft_token>, id 262144 in the vision models') reaches the token check through its
    GGUF vocabulary: <start_of_image> / <end_of_image> are there, the image token is not."""
    from jaxinfer.checkpoints.gguf import load_gguf_tokenizer

    tok = load_gguf_tokenizer(gemma_gguf_path)
    assert tok.token_to_id("<start_of_image>") is not None
    with pytest.raises(OptionError) as e:
        _load(gemma_gguf_path, mmproj=str(files["f32"]), max_slots=1, max_model_len=64)
    assert e.value.option == "mmproj" and "['<image_soft_token>']" in str(e.value)


def test_option_attaches_the_tower(text_dir, files):
    prepared = _load(text_dir, mmproj=str(files["f32"]), max_slots=2, max_model_len=128)
    direct = load_gguf_mmproj(files["f32"], IDS)
    assert prepared.vision.kind == "gemma3" and prepared.vision.cfg == direct.cfg
    for a, b in zip(jax.tree_util.tree_leaves(prepared.vision.params),
                    jax.tree_util.tree_leaves(direct.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_engine_with_mmproj_runs_images_as_hf(text_dir, files, hf_f16_proj, llm_for):
    """LLM(text model, mmproj=...) on prompts with images: greedy tokens equal to HF's
    vision-language model (the one the two files hold: projection in f16), logprobs within 1e-4
    (the image tokens attend to each other both ways, as HF's Gemma 3 does)."""
    from jaxinfer import SamplingParams

    llm = llm_for(text_dir, mmproj=str(files["f32"]), max_slots=2, page_size=8,
                  max_model_len=256, prefill_chunk=vm.MM_TOKENS_PER_IMAGE, tensor_parallel=1)
    a, b = vm.random_image(1), vm.random_image(2, (90, 30, 3))
    prompts = [{"prompt": "Look: <start_of_image> what is it?", "multi_modal_data": {"image": a}},
               {"prompt": "Two: <start_of_image> then <start_of_image>.",
                "multi_modal_data": {"image": [b, a]}}]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                logprobs=0))
    for o, ims in zip(outs, [[a], [b, a]]):
        ids = o.prompt_token_ids
        assert ids.count(vm.IMAGE_TOKEN_ID) == vm.MM_TOKENS_PER_IMAGE * len(ims)
        full = torch.tensor([ids + o.token_ids[:-1]])
        with torch.no_grad():
            logits = hf_f16_proj(input_ids=full, pixel_values=_pixels(ims),
                                 token_type_ids=(full == vm.IMAGE_TOKEN_ID).long()).logits
        steps = torch.log_softmax(logits[0].float(), -1).numpy()[len(ids) - 1:]
        assert o.token_ids == steps.argmax(-1).tolist()
        np.testing.assert_allclose([lp["logprob"] for lp in o.logprobs],
                                   [steps[j, t] for j, t in enumerate(o.token_ids)], atol=1e-4)


def _pixels(images) -> torch.Tensor:
    from jaxinfer.runtime.host.images import load_image, pixel_values

    px = [pixel_values(load_image(im, "x"), vm.IMAGE_SIZE, vm.IMAGE_MEAN, vm.IMAGE_STD)
          for im in images]
    return torch.tensor(np.stack(px)).permute(0, 3, 1, 2)
