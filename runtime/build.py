"""The prepare step: a model as loaded -> the model in the form the engine runs it.

Everything decided once, before the engine exists, happens here and nowhere else:
  * `load(model, options)`: the options checked (EngineConfig), how weights stream in (quantized
    as they load, kept as GGUF blocks, or straight into tensor-parallel shards), the checkpoint's
    own quantization and its mode, the options the model sets when the caller did not
    (`max_model_len`, `tensor_parallel` over the host's cores on CPU), the draft model;
  * `prepare(cfg, params, tokenizer, config)`: the mesh, the attention backend, the LoRA stack,
    and the weights' engine form (runtime/weights.py: fused Q/K/V and gate/up projections,
    sharding, the CPU's output-major layout; `update_weights` builds a new version the same
    way).

    model = load("gemma3-270m", {"max_slots": 16})
    engine = Engine(model)                  # runtime/engine.py: takes the params as they are

`Prepared` is the result: what the engine runs, and what `LLM.model` shows (cfg, params,
tokenizer, source).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from jaxinfer.runtime.config import FORMATS, EngineConfig, ModelConfig


@dataclass
class Prepared:
    cfg: ModelConfig
    params: object  # runtime.device.model.Params, as the engine runs them
    tokenizer: object  # runtime.host.tokenizer.Tokenizer
    config: EngineConfig  # every option resolved
    mesh: object = None  # jax.sharding.Mesh for tensor parallel / several hosts
    backend: str = "xla"  # the attention backend the steps use (attention.resolve_backend)
    draft: tuple | None = None  # (ModelConfig, Params) of a speculative draft model
    source: str | None = None  # where the weights came from
    vision: object = None  # checkpoints.hf_vision.VisionModel of a vision model (None: text only)


def check_names(options: dict) -> None:
    """TypeError naming the options EngineConfig does not have."""
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"unknown LLM option(s) {unknown}; valid: {sorted(known)}")


def load(model: str, options: dict) -> Prepared:
    """Load `model` (an HF checkpoint dir, a .gguf file, a `jaxinfer convert` dir or a model
    name) under `options` (EngineConfig fields; those not given are the config's defaults or,
    for max_model_len and tensor_parallel, the model's)."""
    from jaxinfer.checkpoints.loader import load_model
    from jaxinfer.checkpoints.quantize import placer, quantization_spec, with_mode
    from jaxinfer.runtime.device.host_devices import auto_tensor_parallel, request_host_devices
    from jaxinfer.runtime.device.quantization import default_mode, keeps_gguf_blocks

    check_names(options)
    q = options.get("quantization")
    place = None
    if q in FORMATS:  # quantize each weight as it streams in (peak ~ the int8 model)
        # LoRA adapters read the norms' outputs as trained: no smoothing / AWQ scales there
        smooth = {"activation_aware": False} if options.get("enable_lora") else {}
        place = placer(q, options.get("dtype", "float32"), mode=options.get("quant_mode"),
                       quantize_embeddings=options.get("quantize_embeddings", True), **smooth)
    config = EngineConfig(**options)  # every option checked before anything loads
    if config.distributed:  # join the multi-host job: one mesh over every process's devices
        from jaxinfer.runtime.device.distributed import init_distributed

        init_distributed()
    request_host_devices()  # before anything starts JAX's backends
    import jax

    from jaxinfer.checkpoints.loader import resolve

    if config.compiled_dir:  # programs compiled ahead (jaxinfer compile): before any compile
        from jaxinfer.runtime.compiled import install

        install(resolve(model), config)

    if jax.default_backend() == "cpu":  # the CPU kernels compile (first use) while it loads
        from jaxinfer.runtime.device import cpu_kernels

        cpu_kernels.prebuild()
    if q == "gguf":
        from jaxinfer.checkpoints.loader import is_gguf_file

        if not is_gguf_file(resolve(model)):
            raise ValueError(f"{model}: quantization='gguf' keeps a GGUF file's quantized "
                             "blocks; this model is not a GGUF file (use quantization=None)")
    mesh = None
    if config.tensor_parallel != 1 or jax.process_count() > 1:
        # tensor parallel: every tensor streams straight into its shards on the mesh
        import jax.numpy as jnp

        from jaxinfer.runtime.device.sharding import make_mesh, shard_placer

        mesh = make_mesh(config.tensor_parallel)
        place = shard_placer(mesh, jnp.dtype(config.dtype), inner=place)
    keep = keeps_gguf_blocks()
    loaded = load_model(model, dtype=config.dtype, place=place, mesh=mesh,
                        keep_quantized=q == "gguf" or (q is None and keep),
                        keep_int4=q == "int4" or (q is None and keep),
                        keep_mxfp4=q in (None, "mxfp4"))
    if config.mmproj is not None:  # llama.cpp's vision tower beside a GGUF text model
        loaded = dataclasses.replace(loaded, vision=_load_mmproj(config.mmproj, loaded, config))
    params, from_model = loaded.params, {}
    spec = quantization_spec(params)  # a converted dir may be quantized already
    if q in ("gguf", "mxfp4") and spec is None:
        raise ValueError(f"{model}: quantization={q!r}: the checkpoint holds no such "
                         "quantized matmul weights (use quantization=None)")
    if spec is not None:
        if q is not None and q != spec["fmt"]:
            raise ValueError(f"{model}: holds {spec['fmt']} weights; cannot serve them as {q!r}")
        from_model["quantization"] = spec["fmt"]
        mode = config.quant_mode or default_mode(spec["fmt"])
        from jaxinfer.checkpoints.orbax_io import is_converted

        if (config.enable_lora and spec["fmt"] == "int8" and spec["mode"] == "w8a8"
                and is_converted(loaded.source)):
            raise ValueError(
                f"{model}: LoRA adapters over an int8 W8A8 checkpoint converted ahead of time "
                "are not supported (its norms may hold SmoothQuant scales the adapters were "
                "not trained with); load the float checkpoint with quantization='int8'")
        if mode != spec["mode"]:
            params = with_mode(params, mode)
    if "max_model_len" not in options:
        from_model["max_model_len"] = min(loaded.cfg.max_position_embeddings, 2048)
    if mesh is None and "tensor_parallel" not in options and not config.batch_invariant:
        # the host's cores, on CPU
        tp = auto_tensor_parallel(loaded.cfg, dataclasses.replace(config, **from_model),
                                  platform=jax.default_backend(), devices=jax.device_count())
        if tp > 1:
            from jaxinfer.runtime.device.sharding import make_mesh

            mesh, from_model["tensor_parallel"] = make_mesh(tp), tp
    config = dataclasses.replace(config, **from_model)
    draft = None
    if config.speculative is not None and config.speculative.method == "draft":
        draft = _load_draft(model, loaded.cfg, params, config)
    # params came from this load alone: the engine's form replaces them as it is built
    prepared = prepare(loaded.cfg, params, loaded.tokenizer, config, mesh=mesh, draft=draft,
                       source=loaded.source, consume=True)
    return dataclasses.replace(prepared, vision=_vision_form(loaded.vision, config, prepared.mesh))


def _vision_form(vision, config: EngineConfig, mesh):
    """A vision encoder as the engine runs it: its layers' products quantized when the language
    model's are (int8 / fp8 / int4 as int8; checkpoints.quantize.quantize_vision), and on a
    mesh split like the language model's layers (heads and MLP width across the "model" axis;
    runtime/device/sharding.py VISION_AXES)."""
    if vision is None:
        return None
    import jax.numpy as jnp

    params = vision.params
    if config.quantization in FORMATS:
        from jaxinfer.checkpoints.quantize import quantize_vision

        params = quantize_vision(params, config.quantization, getattr(jnp, config.dtype),
                                 config.quant_mode)
    if mesh is not None:
        from jaxinfer.runtime.device.sharding import VISION_AXES, shard_params

        params = shard_params(params, mesh, table=VISION_AXES)
    return dataclasses.replace(vision, params=params)


def _load_mmproj(path: str, loaded, config: EngineConfig):
    """The VisionModel of llama.cpp's mmproj file `path` for the text model `loaded` (a Gemma 3
    without a vision tower of its own), its image token ids from `loaded`'s tokenizer."""
    import jax.numpy as jnp

    from jaxinfer.checkpoints.gguf_vision import TOKEN_PIECES, load_gguf_mmproj
    from jaxinfer.runtime.config import OptionError

    if loaded.vision is not None:
        raise OptionError("mmproj", f"{loaded.source} has a vision tower of its own (an mmproj "
                                    "file is for a text-only model)")
    if loaded.cfg.family != "gemma3":
        raise OptionError("mmproj", f"needs a Gemma 3 text model (projector type 'gemma3'); "
                                    f"{loaded.source} is a {loaded.cfg.family!r} model")
    tok = loaded.tokenizer
    ids = {k: tok.token_to_id(piece) if tok is not None else None
           for k, piece in TOKEN_PIECES.items()}
    lacking = [TOKEN_PIECES[k] for k, v in ids.items() if v is None]
    if lacking:
        raise OptionError("mmproj", f"the tokenizer of {loaded.source} lacks the image tokens "
                                    f"{lacking}")
    vision = load_gguf_mmproj(path, ids, getattr(jnp, config.dtype))
    if vision.cfg.text_hidden_size != loaded.cfg.hidden_size:
        raise OptionError("mmproj", f"{path} projects images to width "
                                    f"{vision.cfg.text_hidden_size}; {loaded.source} is "
                                    f"{loaded.cfg.hidden_size} wide")
    return vision


def _load_draft(target: str, cfg: ModelConfig, params, config: EngineConfig) -> tuple:
    """(cfg, params) of the draft model; the target's own weights when it names the target
    (and asks for no other quantization)."""
    from jaxinfer.checkpoints.loader import load_model
    from jaxinfer.checkpoints.quantize import placer
    from jaxinfer.runtime.device.quantization import keeps_gguf_blocks
    from jaxinfer.runtime.proposers import check_vocab

    spec = config.speculative
    same = spec.model == target or (os.path.exists(spec.model) and os.path.exists(target)
                                    and os.path.samefile(spec.model, target))
    kept = spec.quantization is None and config.quantization == "gguf"
    if same and (spec.quantization == config.quantization or kept):
        return cfg, params
    place = placer(spec.quantization, config.dtype) if spec.quantization is not None else None
    keep = spec.quantization is None and keeps_gguf_blocks()
    draft = load_model(spec.model, dtype=config.dtype, place=place, keep_quantized=keep,
                       keep_int4=keep or spec.quantization == "int4", with_vision=False)
    check_vocab(cfg, draft.cfg, repr(spec.model))
    return draft.cfg, draft.params


def _quantized(params) -> bool:
    """Whether any weight of `params` is a QuantizedArray."""
    import jax

    from jaxinfer.runtime.device.quantization import QuantizedArray

    is_q = lambda x: isinstance(x, QuantizedArray)  # noqa: E731
    return any(is_q(x) for x in jax.tree.leaves(params, is_leaf=is_q))


def prepare(cfg: ModelConfig, params, tokenizer, config: EngineConfig, *, mesh=None,
            draft: tuple | None = None, source: str | None = None,
            consume: bool = False) -> Prepared:
    """The loaded parameters in the form the engine runs them, under `config`. A draft that is
    the target itself (`draft[1] is params`) follows the target's form. `consume`: `params`
    are given up to the engine (engine_form deletes what it lays out anew)."""
    import jax

    from jaxinfer.runtime.device.attention import resolve_backend
    from jaxinfer.runtime.weights import engine_form

    loaded = params
    backend = resolve_backend(config.attention_backend)
    if config.batch_invariant:
        cfg = dataclasses.replace(cfg, batch_invariant=True)
        if config.attention_backend is None:  # the XLA path unless a kernel is asked for
            backend = "xla"
        if config.tensor_parallel > 2 and _quantized(params):
            from jaxinfer.runtime.config import OptionError

            raise OptionError("batch_invariant", "on more than two devices runs float weights "
                              "(its fixed-order sums take dense products): load with "
                              "quantization='dequantize' or none")
    if mesh is None and (config.tensor_parallel > 1 or jax.process_count() > 1):
        from jaxinfer.runtime.device.sharding import make_mesh

        mesh = make_mesh(config.tensor_parallel)
    if config.enable_lora:
        from jaxinfer.runtime.device.lora import init_lora

        if jax.process_count() > 1:
            raise ValueError("LoRA adapters with several hosts are not supported yet")
        params = params.replace(lora=init_lora(cfg, config.max_loras, config.max_lora_rank))
    params = engine_form(params, config, mesh, consume=consume)
    if draft is not None and draft[1] is loaded:  # the target drafts itself
        draft = (draft[0], params)
    return Prepared(cfg=cfg, params=params, tokenizer=tokenizer, config=config, mesh=mesh,
                    backend=backend, draft=draft, source=source)
