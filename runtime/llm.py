"""The public Python API: `LLM(model).generate(prompts, SamplingParams(...))`, `stream`, `embed`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace

import numpy as np

from jaxinfer.runtime.beam_search import BeamSearch, BeamSearchParams, run_searches
from jaxinfer.runtime.build import load
from jaxinfer.runtime.embedding import checkpoint_defaults, embedder
from jaxinfer.runtime.engine import Engine
from jaxinfer.runtime.host.errors import RequestError
from jaxinfer.runtime.host.image_prompt import parse_multimodal
from jaxinfer.runtime.host.outputs import RequestDelta, RequestOutput, best_of, grouped
from jaxinfer.runtime.host.requests import (LoRARequest, SamplingParams, check_request,
                                            parse_prompt, sample_params)


class LLM:
    """`LLM(model, **engine_options)`: `model` is an HF checkpoint dir, a .gguf file, a dir
    written by `jaxinfer convert`, or the name "gemma3-270m". Keyword arguments mirror
    EngineConfig fields. `llm.model`: the model as the engine runs it (cfg, params, tokenizer,
    source; runtime/build.py), `llm.config`: every option resolved, `llm.engine`: the engine."""

    def __init__(self, model: str = "gemma3-270m", **options):
        enable_compilation_cache()
        prepared = load(model, options)
        self.config, self.tokenizer = prepared.config, prepared.tokenizer
        self.engine = Engine(prepared)
        # the weights live in the engine alone (update_weights replaces them; sleep frees them)
        self._model = replace(prepared, params=None, draft=None)
        # "generate" or "embed" (EngineConfig.task resolved) and the default embedding pooling
        auto, pooling = checkpoint_defaults(self.model.source, self.model.cfg.architecture)
        self.task = auto if self.config.task == "auto" else self.config.task
        embedder(self.engine, pooling)
        self.warmup_stats: dict | None = None  # {"programs", "seconds"} of warmup()
        if self.config.warmup:  # compile mode "background": queued, not waited for
            self.warmup(wait=not self.engine.background_compiles)

    @property
    def model(self):
        """The model as the engine runs it: runtime/build.py's Prepared, with the engine's
        current weights."""
        return replace(self._model, params=self.engine.params)

    def warmup(self, wait: bool = True, first_answers: bool = False) -> dict:
        """Compile every step shape the engine can run (Engine.warmup: token x page x q-length
        buckets, the verify and draft steps), up front, so no request waits on a compile.
        Returns {"programs": step programs launched for the first time by this engine,
        "seconds": wall time}; programs compiled earlier (the persistent cache, another engine
        of the same model in this process) load instead of compiling. Under task "embed":
        the embedding programs (runtime/embedding.py), not the steps. `wait=False` (compile
        mode "background"): the step programs are queued on the background compiler and this
        returns at once ("programs": 0); requests meanwhile run layer by layer.
        `first_answers`: before that, answer a prompt in each token bucket (in compile mode
        "background": the small programs a fresh start runs first, layer by layer), and wait for
        every compile those queued (`jaxinfer compile` ships them all)."""
        import logging
        import time

        t0 = time.perf_counter()
        if first_answers and self.task != "embed":
            ids = self.tokenizer.encode("Hello") or [0]
            sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
            for t in self.engine.shapes.tokens:
                n = max(1, min(t, self.config.max_model_len - 2))
                self.generate([(ids * n)[:n]], sp)
        n = (embedder(self.engine).warmup() if self.task == "embed"
             else self.engine.warmup(wait=wait))
        if first_answers:
            self.engine.settle()
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

    def _parse(self, prompt) -> tuple[str | None, list[int], list]:
        """A prompt (text, ids, or a dict with "multi_modal_data") -> (text, ids, images)."""
        limits = self.engine.limits
        if not isinstance(prompt, dict):
            return (*parse_prompt(prompt, self.tokenizer, limits), [])
        return parse_multimodal(prompt, self.tokenizer, self.engine.image_door(),
                                lambda p, name: parse_prompt(p, self.tokenizer, limits, name))

    # ---- API ------------------------------------------------------------------------------
    def generate(self, prompts, sampling_params=None, *, use_tqdm: bool = False,
                 lora_request=None) -> list[RequestOutput]:
        """One RequestOutput per prompt. With `n` / `best_of`, its `outputs` lists the n
        completions (best_of > n: the best_of samples' n highest cumulative logprobs, best
        first; their logprobs are computed for the ranking and returned only when asked for);
        its own fields are the first's. With a seed, sample i uses seed + i. The samples share
        the prompt's full KV pages (the scheduler admits the siblings once the first has
        computed them). `lora_request`: a LoRARequest for every prompt, or a list with one (or
        None) per prompt (needs enable_lora=True)."""
        prompts = _prompt_list(prompts)
        limits = self.engine.limits
        inputs = [self._parse(p) for p in prompts]
        params = self._params_list(len(inputs), sampling_params)
        for (_, pids, _), sp in zip(inputs, params):  # validate all before admitting any
            check_request(pids, sp, limits)
        loras = self._lora_names(len(inputs), lora_request)
        groups, ids, done = [], [], {}
        try:
            for (text, pids, images), sp, lora in zip(inputs, params, loras):
                groups.append([self.engine.add_request(pids, s, lora=lora, prompt=text,
                                                       images=images)
                               for s in _samples(sp)])
                ids += groups[-1]
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
        return [_group([done[rid] for rid in g], sp) for g, sp in zip(groups, params)]

    def beam_search(self, prompts, params: BeamSearchParams, *,
                    lora_request: LoRARequest | None = None) -> list[RequestOutput]:
        """Beam search (runtime/beam_search.py: HF transformers' scoring, one engine round per
        token, the beams' common full pages shared through the prefix cache, each beam's last
        partial page recomputed every round). One RequestOutput per prompt whose `outputs`
        are the beam_width hypotheses, best score first (score: cumulative_logprob /
        len(token_ids) ** length_penalty)."""
        prompts = _prompt_list(prompts)
        limits = self.engine.limits
        inputs = [parse_prompt(p, self.tokenizer, limits) for p in prompts]
        searches = [BeamSearch(pids, params, limits, text) for text, pids in inputs]
        run_searches(searches, lambda asks: self.generate(
            [ids for ids, _ in asks], [sp for _, sp in asks], lora_request=lora_request))
        return [s.output(self.tokenizer, f"beam-{i}") for i, s in enumerate(searches)]

    def stream(self, prompt, sampling_params: SamplingParams | None = None, *,
               lora_request: LoRARequest | None = None) -> Iterator[RequestDelta]:
        """The request's deltas as its steps come back: text (stop strings held back), token
        ids, their logprob entries when `logprobs` is set, the prompt's logprobs on the first
        one; the last is `finished` and carries the whole `output`."""
        text, pids, images = self._parse(prompt)
        sp = sampling_params or SamplingParams()
        if sp.n > 1 or (sp.best_of or 1) > 1:
            raise RequestError("n", "stream() yields one completion: use generate() for n or "
                                    "best_of above 1")
        lora = self._lora_names(1, lora_request)[0]
        rid = self.engine.add_request(pids, sp, lora=lora, prompt=text, images=images)
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

    # ---- weights (RL rollouts: runtime/weights.py) -----------------------------------------
    def get_weights(self):
        """The weights in the model's own layout (runtime/weights.py's module doc): the Params
        tree `update_weights` takes and `runtime.device.scoring.sequence_logprobs` runs."""
        return self.engine.get_weights()

    def update_weights(self, weights, *, version: int | str | None = None,
                       policy: str = "drain") -> int | str:
        """Serve new weights in place, with no recompile: a Params tree in get_weights()'s
        layout (trainer arrays on the engine's devices are used without a copy), or a checkpoint
        dir / file of this model. Atomic: a missing or mis-shaped tensor (named in the
        WeightError), a NaN, a failure while building leaves the current version serving.
        Quantized engines (int8 / fp8 / int4) quantize the new weights as at load; kept GGUF
        blocks cannot be rebuilt (WeightError). `policy` for unfinished requests: "drain" (their
        tokens all come from the old weights) or "abort". Returns the new version, which every
        RequestOutput after it carries as `weight_version`."""
        return self.engine.update_weights(weights, version=version, policy=policy)

    def logprob_fn(self):
        """`fn(params, tokens [B, L]) -> [B, L - 1]` f32: each next token's logprob, the pure
        function a trainer differentiates (runtime/device/scoring.py), bound to this engine's
        model config, page size, page-table width and sampled vocabulary. With
        batch_invariant=True and params = get_weights(), it equals the logprobs the engine's
        rollouts report, bit for bit."""
        from jaxinfer.runtime.device.scoring import sequence_logprobs

        cfg, c, vocab = self.engine.cfg, self.config, self.engine.text_vocab

        def logprobs(params, tokens):
            return sequence_logprobs(params, cfg, tokens, page_size=c.page_size,
                                     table_pages=c.pages_per_seq, vocab_limit=vocab)

        return logprobs

    def update_lora(self, name: str, weights):
        """RL with adapters: serve LoRA adapter `name` from new weights (a PEFT dir, or a dict
        {PEFT tensor name: array} keeping the adapter's rank and alpha), in its device slot's
        place, with no recompile; refused while an unfinished request uses it; a bad adapter
        leaves the old one serving. -> runtime.adapters.Adapter."""
        return self.engine.update_lora(name, weights)

    @property
    def weight_version(self) -> int | str:
        return self.engine.weight_version

    def sleep(self, level: int = 1) -> dict:
        """Free the KV cache (level 1) and the weights too (level 2, kept on the host) for a
        colocated trainer; requests are refused until wake_up(). Device bytes before / after."""
        return self.engine.sleep(level)

    def wake_up(self) -> dict:
        return self.engine.wake_up()

    def score(self, prompts, completions, *, lora_request: LoRARequest | None = None
              ) -> list[list[float]]:
        """Teacher-forced logprobs: for each (prompt, completion) pair (text or token ids), the
        logprob of each completion token given the prompt and the completion tokens before it,
        under the serving weights, computed by the engine's own steps (a prompt-logprob
        prefill). Text completions are tokenized without special tokens. One list per pair."""
        prompts, completions = _prompt_list(prompts), _prompt_list(completions)
        for name, v in (("prompts", prompts), ("completions", completions)):
            if isinstance(v, (str, bytes)) or not isinstance(v, Sequence) or not v:
                raise RequestError(name, "must be a prompt or a non-empty list of them")
        if len(prompts) != len(completions):
            raise RequestError("completions", f"needs one completion per prompt "
                                              f"({len(prompts)}), got {len(completions)}")
        limits = self.engine.limits
        seqs, cuts = [], []
        for i, (p, c) in enumerate(zip(prompts, completions)):
            pids = parse_prompt(p, self.tokenizer, limits)[1]
            if isinstance(c, str):
                cids = self.tokenizer.encode(c, add_special_tokens=False)
            elif isinstance(c, Sequence) and all(isinstance(t, int) and not isinstance(t, bool)
                                                 for t in c):
                cids = list(c)
            else:
                raise RequestError(f"completions[{i}]", "must be text or a list of token ids")
            if not cids:
                raise RequestError(f"completions[{i}]", "is empty")
            seqs.append(pids + cids)
            cuts.append(len(pids))
        outs = self.generate(seqs, SamplingParams(max_tokens=1, temperature=0,
                                                  prompt_logprobs=0),
                             lora_request=lora_request)
        return [[e["logprob"] for e in o.prompt_logprobs[cut:]] for o, cut in zip(outs, cuts)]

    def embed(self, prompts, pooling: str | None = None, normalize: bool = True) -> np.ndarray:
        """Embeddings of one prompt or a list (text or token ids): f32 [n, D], the final-normed
        hidden states pooled per prompt ("last", "mean", "cls"; None: the checkpoint's, see
        runtime/embedding.py), L2-normalized unless normalize=False. Runs the model's prefill
        with no KV pages kept. RequestError naming the field."""
        prompts = _prompt_list(prompts)
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
            raise RequestError("prompts", "must be a prompt or a non-empty list of prompts")
        ids = [parse_prompt(p, self.tokenizer, self.engine.limits)[1] for p in prompts]
        return self.engine.embed(ids, pooling=pooling, normalize=normalize)


def _prompt_list(prompts) -> list:
    """One prompt (text, ids or a dict) or a list of them -> a list."""
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
    ):
        return [prompts]
    return prompts


def _samples(sp: SamplingParams) -> list[SamplingParams]:
    """The engine requests of one prompt: best_of (else n) samples, seeded by `sample_params`;
    ranking best_of > n needs each sample's logprobs, computed even when not asked for."""
    count = sp.best_of or sp.n
    if count > sp.n and sp.logprobs is None:
        sp = replace(sp, logprobs=0)
    return sample_params(sp, count)


def _group(outs: list[RequestOutput], sp: SamplingParams) -> RequestOutput:
    """One prompt's samples -> its RequestOutput (one sample: as the engine made it)."""
    if len(outs) == 1:
        return outs[0]
    if sp.logprobs is None:
        outs = [replace(o, logprobs=None) for o in outs]
    return grouped(best_of(outs, sp.n))


def enable_compilation_cache() -> None:
    """Persist compiled steps across processes (first run compiles, later runs load) unless the
    caller configured a cache already: ~/.cache/jaxinfer/xla/<this CPU's tag> (compiled.cpu_tag;
    XLA:CPU code is built for the host's instruction set). JAXINFER_COMPILATION_CACHE=DIR
    overrides, =0 disables.
    Programs that compiled in under 0.1 s are not kept (loading them costs about as much),
    unless jax's own JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS says otherwise: the programs
    that start an engine quickly (runtime/device/programs.py) take 0.1-1 s each."""
    import os

    import jax

    from jaxinfer.runtime.compiled import cpu_tag, use_cache

    where = os.environ.get("JAXINFER_COMPILATION_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "jaxinfer", "xla", cpu_tag())
    if where == "0" or jax.config.jax_compilation_cache_dir:
        return
    use_cache(where, None if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" in os.environ else 0.1)


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
