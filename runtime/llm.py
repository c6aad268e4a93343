"""The public Python API: `LLM(model).generate(prompts, SamplingParams(...))` and `stream`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from jaxinfer.runtime.build import load
from jaxinfer.runtime.engine import Engine
from jaxinfer.runtime.host.errors import RequestError
from jaxinfer.runtime.host.outputs import RequestDelta, RequestOutput
from jaxinfer.runtime.host.requests import LoRARequest, SamplingParams, check_request, parse_prompt


class LLM:
    """`LLM(model, **engine_options)`: `model` is an HF checkpoint dir, a .gguf file, a dir
    written by `jaxinfer convert`, or the name "gemma3-270m". Keyword arguments mirror
    EngineConfig fields. `llm.model`: the model as the engine runs it (cfg, params, tokenizer,
    source; runtime/build.py), `llm.config`: every option resolved, `llm.engine`: the engine."""

    def __init__(self, model: str = "gemma3-270m", **options):
        enable_compilation_cache()
        self.model = load(model, options)
        self.config, self.tokenizer = self.model.config, self.model.tokenizer
        self.engine = Engine(self.model)
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
        limits = self.engine.limits
        inputs = [parse_prompt(p, self.tokenizer, limits) for p in prompts]
        params = self._params_list(len(inputs), sampling_params)
        for (_, pids), sp in zip(inputs, params):  # validate all before admitting any
            check_request(pids, sp, limits)
        loras = self._lora_names(len(inputs), lora_request)
        ids, done = [], {}
        try:
            for (text, pids), sp, lora in zip(inputs, params, loras):
                ids.append(self.engine.add_request(pids, sp, lora=lora, prompt=text))
            bar, mine = _progress(len(ids), use_tqdm), set(ids)
            while len(done) < len(ids):
                for d in self.engine.step():
                    if d.finished and d.request_id in mine:
                        done[d.request_id] = d.output
                        bar.update(1)
            bar.close()
        finally:  # interrupted (or refused midway): nothing of this call stays in the engine
            for rid in ids:
                if rid not in done:
                    self.engine.abort(rid)
        return [done[rid] for rid in ids]

    def stream(self, prompt, sampling_params: SamplingParams | None = None, *,
               lora_request: LoRARequest | None = None) -> Iterator[RequestDelta]:
        """The request's deltas as its steps come back: text (stop strings held back), token
        ids, their logprob entries when `logprobs` is set, the prompt's logprobs on the first
        one; the last is `finished` and carries the whole `output`."""
        text, pids = parse_prompt(prompt, self.tokenizer, self.engine.limits)
        lora = self._lora_names(1, lora_request)[0]
        rid = self.engine.add_request(pids, sampling_params or SamplingParams(), lora=lora,
                                      prompt=text)
        try:
            done = False
            while not done:
                for d in self.engine.step():
                    if d.request_id == rid:
                        done = d.finished
                        if d.text or d.token_ids or d.finished:
                            yield d
        finally:
            self.engine.abort(rid)  # a consumer that stopped early frees its slot and pages

    def generate_jsonl(self, in_path, out_path, **kw) -> dict:
        """Run a JSONL file through the engine (see `runtime.host.batch.run_batch` for the
        format and options: sampling=dict(...), resume, ordered, ...); returns the summary."""
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
