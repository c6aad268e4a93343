"""The public Python API: `LLM(model).generate(prompts, SamplingParams(...))` and `stream`."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from jaxinfer.runtime.config import FORMATS, QUANTIZATIONS, EngineConfig
from jaxinfer.runtime.engine import Engine
from jaxinfer.runtime.device.host_devices import auto_tensor_parallel, request_host_devices
from jaxinfer.runtime.device.quantization import default_mode, keeps_gguf_blocks
from jaxinfer.runtime.host.requests import (Limits, LoRARequest, RequestError, RequestOutput,
                                       SamplingParams, check_request, parse_prompt)


@dataclass
class StreamDelta:
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None


class LLM:
    """`LLM(model, **engine_options)`: `model` is an HF checkpoint dir, a .gguf file, a dir
    written by `jaxinfer convert`, or the name "gemma3-270m". Keyword arguments mirror
    EngineConfig fields."""

    def __init__(self, model: str = "gemma3-270m", **options):
        from jaxinfer.checkpoints.loader import load_model

        enable_compilation_cache()
        if options.get("distributed"):  # join the multi-host job: one mesh over every process
            from jaxinfer.runtime.device.distributed import init_distributed

            init_distributed()
        request_host_devices()  # before anything starts JAX's backends
        known = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown LLM option(s) {unknown}; valid: {sorted(known)}")
        q = options.get("quantization")
        if q not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {q!r}")
        place = None
        if q in FORMATS:  # quantize each weight as it streams in (peak ~ the int8 model)
            from jaxinfer.checkpoints.quantize import placer

            # LoRA adapters read the norms' outputs as trained: no smoothing / AWQ scales there
            smooth = {"activation_aware": False} if options.get("enable_lora") else {}
            place = placer(q, options.get("dtype", "float32"), mode=options.get("quant_mode"),
                           quantize_embeddings=options.get("quantize_embeddings", True), **smooth)
        config = EngineConfig(**options)  # every option checked (and parsed) before any loading
        if q == "gguf":
            from jaxinfer.checkpoints.loader import is_gguf_file, resolve

            if not is_gguf_file(resolve(model)):
                raise ValueError(f"{model}: quantization='gguf' keeps a GGUF file's quantized "
                                 "blocks; this model is not a GGUF file (use quantization=None)")
        mesh = None
        if options.get("tensor_parallel", 1) != 1 or _multi_process():
            # tensor parallel: every tensor streams straight into its shards on the mesh
            import jax.numpy as jnp

            from jaxinfer.runtime.device.sharding import make_mesh, shard_placer

            mesh = make_mesh(options.get("tensor_parallel", 1))
            place = shard_placer(mesh, jnp.dtype(options.get("dtype", "float32")), inner=place)
        self.model = load_model(model, dtype=options.get("dtype", "float32"), place=place,
                                mesh=mesh,
                                keep_quantized=q == "gguf" or (q is None and keeps_gguf_blocks()),
                                keep_int4=q == "int4" or (q is None and keeps_gguf_blocks()))
        from jaxinfer.checkpoints.quantize import quantization_spec, with_mode

        from_model = {}
        spec = quantization_spec(self.model.params)  # a converted dir may be quantized already
        if q == "gguf" and spec is None:
            raise ValueError(f"{model}: quantization='gguf': the file holds no block-quantized "
                             "matmul weights (use quantization=None)")
        if spec is not None:
            if q is not None and q != spec["fmt"]:
                raise ValueError(f"{model}: holds {spec['fmt']} weights; cannot serve them as {q!r}")
            from_model["quantization"] = spec["fmt"]
            mode = config.quant_mode or default_mode(spec["fmt"])
            from jaxinfer.checkpoints.orbax_io import is_converted

            if (config.enable_lora and spec["fmt"] == "int8" and spec["mode"] == "w8a8"
                    and is_converted(self.model.source)):
                raise ValueError(
                    f"{model}: LoRA adapters over an int8 W8A8 checkpoint converted ahead of time "
                    "are not supported (its norms may hold SmoothQuant scales the adapters were "
                    "not trained with); load the float checkpoint with quantization='int8'")
            if mode != spec["mode"]:
                self.model.params = with_mode(self.model.params, mode)
        if "max_model_len" not in options:
            from_model["max_model_len"] = min(self.model.cfg.max_position_embeddings, 2048)
        if mesh is None and "tensor_parallel" not in options:  # the host's cores, on CPU
            import jax

            tp = auto_tensor_parallel(self.model.cfg, dataclasses.replace(config, **from_model),
                                      platform=jax.default_backend(), devices=jax.device_count())
            if tp > 1:
                from jaxinfer.runtime.device.sharding import make_mesh

                mesh, from_model["tensor_parallel"] = make_mesh(tp), tp
        self.config = dataclasses.replace(config, **from_model)
        self.tokenizer = self.model.tokenizer
        draft = None
        speculative = self.config.speculative
        if speculative is not None and speculative.method == "draft":
            draft = self._load_draft(model, speculative, self.config.dtype)
        self.engine = Engine(self.model.cfg, self.model.params, self.tokenizer, self.config,
                             mesh=mesh, draft_model=draft)
        # the engine's layer weights (sharded, or stored output-major) replace the loaded ones
        self.model.params = self.model.params.replace(layers=self.engine.params.layers)
        self.warmup_stats: dict | None = None  # {"programs", "seconds"} of warmup()
        if self.config.warmup:
            self.warmup()

    def warmup(self) -> dict:
        """Compile every step shape the engine can run (Engine.warmup: token x page x q-length
        buckets, the verify and draft steps), up front, so no request waits on a compile.
        Returns {"programs": step programs launched for the first time by this engine,
        "seconds": wall time}; programs compiled earlier (the persistent cache, another engine
        of the same model in this process) load instead of compiling."""
        import logging
        import time

        t0 = time.perf_counter()
        n = self.engine.warmup()
        self.warmup_stats = {"programs": n, "seconds": time.perf_counter() - t0}
        logging.getLogger(__name__).info("warm-up: %d step programs ready in %.1f s", n,
                                         self.warmup_stats["seconds"])
        return self.warmup_stats

    def _load_draft(self, target: str, spec, dtype: str):
        """(cfg, params) of the draft model; the target's own weights when it names the target
        (and asks for no other quantization)."""
        import os

        from jaxinfer.checkpoints.loader import load_model
        from jaxinfer.runtime.proposers import check_vocab

        same = spec.model == target or (os.path.exists(spec.model) and os.path.exists(target)
                                        and os.path.samefile(spec.model, target))
        kept = spec.quantization is None and self.config.quantization == "gguf"
        if same and (spec.quantization == self.config.quantization or kept):
            return self.model.cfg, self.model.params
        place = None
        if spec.quantization is not None:
            from jaxinfer.checkpoints.quantize import placer

            place = placer(spec.quantization, dtype)
        keep = spec.quantization is None and keeps_gguf_blocks()
        draft = load_model(spec.model, dtype=dtype, place=place, keep_quantized=keep,
                           keep_int4=keep or spec.quantization == "int4")
        check_vocab(self.model.cfg, draft.cfg, repr(spec.model))
        return draft.cfg, draft.params

    # ---- inputs ---------------------------------------------------------------------------
    def _params_list(self, n: int, sampling_params) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        sp = list(sampling_params)
        if len(sp) != n or not all(isinstance(p, SamplingParams) for p in sp):
            raise RequestError("sampling_params", f"needs one SamplingParams per prompt ({n}), "
                                                  f"got {len(sp)} items")
        return sp

    def _lora_names(self, n: int, lora_request) -> list[str | None]:
        """One adapter name (or None) per prompt; each adapter registered on first sight."""
        if lora_request is None:
            return [None] * n
        reqs = [lora_request] * n if isinstance(lora_request, LoRARequest) else list(lora_request)
        if len(reqs) != n:
            raise RequestError("lora_request", f"needs one LoRARequest (or None) per prompt "
                                               f"({n}), got {len(reqs)} items")
        for r in reqs:
            if r is not None and not isinstance(r, LoRARequest):
                raise RequestError("lora_request", f"expected a LoRARequest or None, got "
                                                   f"{type(r).__name__}")
            if r is not None:
                try:
                    self.engine.add_lora(r.lora_name, r.lora_path)
                except ValueError as e:
                    raise RequestError("lora_request", str(e)) from None
        return [None if r is None else r.lora_name for r in reqs]

    # ---- API ------------------------------------------------------------------------------
    def generate(self, prompts, sampling_params=None, *, use_tqdm: bool = False,
                 lora_request=None) -> list[RequestOutput]:
        """`lora_request`: a LoRARequest for every prompt, or a list with one (or None) per
        prompt (needs enable_lora=True)."""
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        limits = Limits.of(self.engine)
        inputs = [parse_prompt(p, self.tokenizer, limits) for p in prompts]
        params = self._params_list(len(inputs), sampling_params)
        for (_, pids), sp in zip(inputs, params):  # validate all before admitting any
            check_request(pids, sp, limits)
        loras = self._lora_names(len(inputs), lora_request)
        ids = []
        try:
            for (_, pids), sp, lora in zip(inputs, params, loras):
                ids.append(self.engine.add_request(pids, sp, lora=lora))
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
                self.engine.pop(rid)
            raise
        bar = _progress(len(ids), use_tqdm)
        pending = set(ids)
        while pending:
            for d in self.engine.step():
                if d.finished and d.request_id in pending:
                    pending.discard(d.request_id)
                    bar.update(1)
        bar.close()
        return [RequestOutput.from_state(self.engine.pop(rid), text) for rid, (text, _) in zip(ids, inputs)]

    def stream(self, prompt, sampling_params: SamplingParams | None = None, *,
               lora_request: LoRARequest | None = None) -> Iterator[StreamDelta]:
        _, pids = parse_prompt(prompt, self.tokenizer, Limits.of(self.engine))
        lora = self._lora_names(1, lora_request)[0]
        rid = self.engine.add_request(pids, sampling_params or SamplingParams(), lora=lora)
        try:
            done = False
            while not done:
                for d in self.engine.step():
                    if d.request_id == rid:
                        done = d.finished
                        if d.text or d.token_ids or d.finished:
                            yield StreamDelta(d.text, d.token_ids, d.finished, d.finish_reason)
        finally:
            self.engine.abort(rid)
            self.engine.pop(rid)

    def generate_jsonl(self, in_path, out_path, **kw) -> dict:
        """Run a JSONL file through the engine (see `runtime.host.batch.run_batch` for the format and
        options: sampling=dict(...), resume, ordered, ...); returns the summary dict."""
        from jaxinfer.runtime.host.batch import run_batch

        return run_batch(self.engine, self.tokenizer, str(in_path), str(out_path), **kw)


def enable_compilation_cache() -> None:
    """Persist compiled steps across processes (first run compiles, later runs load) unless the
    caller configured a cache already. JAXINFER_COMPILATION_CACHE=DIR overrides, =0 disables.
    Programs that compiled in under a second are not kept, unless jax's own
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS says otherwise."""
    import os

    import jax

    where = os.environ.get("JAXINFER_COMPILATION_CACHE",
                           os.path.join(os.path.expanduser("~"), ".cache", "jaxinfer", "xla"))
    if where == "0" or jax.config.jax_compilation_cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", where)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def _multi_process() -> bool:
    import jax

    return jax.process_count() > 1


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req")
