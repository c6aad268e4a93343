"""The public Python API: `LLM(model).generate(prompts, SamplingParams(...))` and `stream`."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from runtime.config import EngineConfig, SamplingParams
from runtime.engine import Engine, RequestState

QUANTIZATIONS = (None, "int8", "fp8")


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort"
    metrics: dict = field(default_factory=dict)  # queue_s, ttft_s, itl_s (list), itl_s_mean, e2e_s
    logprobs: list[dict] | None = None

    @property
    def usage(self) -> dict:
        return {"prompt_tokens": len(self.prompt_token_ids), "completion_tokens": len(self.token_ids)}


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
        from checkpoints.loader import load_model

        known = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown LLM option(s) {unknown}; valid: {sorted(known)}")
        q = options.get("quantization")
        if q not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {q!r}")
        if q is not None:
            raise NotImplementedError(f"quantization={q!r} is not available yet")
        if options.get("speculative"):
            raise NotImplementedError("speculative decoding is not available yet")
        if options.get("tensor_parallel", 1) != 1:
            raise NotImplementedError("tensor_parallel > 1 is not available yet")
        self.model = load_model(model, dtype=options.get("dtype", "float32"))
        options.setdefault(
            "max_model_len", min(self.model.cfg.max_position_embeddings, 2048)
        )
        self.config = EngineConfig(**options)
        self.tokenizer = self.model.tokenizer
        self.engine = Engine(self.model.cfg, self.model.params, self.tokenizer, self.config)

    # ---- inputs ---------------------------------------------------------------------------
    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
            if not prompt:
                raise ValueError("prompt token id list is empty")
            return None, list(prompt)
        raise TypeError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")

    def _params_list(self, n: int, sampling_params) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        sp = list(sampling_params)
        if len(sp) != n:
            raise ValueError(f"{len(sp)} sampling_params for {n} prompts")
        return sp

    # ---- API ------------------------------------------------------------------------------
    def generate(self, prompts, sampling_params=None, *, use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        inputs = [self._prompt_ids(p) for p in prompts]  # validate all before admitting any
        params = self._params_list(len(inputs), sampling_params)
        ids = []
        try:
            for (_, pids), sp in zip(inputs, params):
                ids.append(self.engine.add_request(pids, sp))
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
        return [self._output(self.engine.pop(rid), text) for rid, (text, _) in zip(ids, inputs)]

    def stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        text, pids = self._prompt_ids(prompt)
        rid = self.engine.add_request(pids, sampling_params or SamplingParams())
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

    @staticmethod
    def _output(st: RequestState, prompt_text: str | None) -> RequestOutput:
        return RequestOutput(
            request_id=st.request_id, prompt=prompt_text, prompt_token_ids=st.prompt_ids,
            text=st.text, token_ids=st.token_ids, finish_reason=st.finish_reason,
            metrics=st.metrics.summary(),
            logprobs=st.logprobs if st.params.logprobs is not None else None,
        )


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
