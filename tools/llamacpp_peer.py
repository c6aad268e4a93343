"""llama.cpp as a benchmark peer: greedy decode of one GGUF through llama-cpp-python's C API.

Not a dependency: install it where you compare (it builds from its sdist in ~7 minutes). On
AVX-512 hosts with AMX its `GGML_NATIVE=ON` build crashed at the first decode (AMX path);
build with explicit flags and AMX off, e.g.

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
      -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF \
      -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF" FORCE_CMAKE=1 \
      pip install --no-binary llama-cpp-python llama-cpp-python==0.3.36

`decode(path, prompt_ids, batch, tokens)` decodes `batch` copies of the prompt together (one
sequence id each, one token per sequence per llama_decode call: llama.cpp's batched decoding,
as its llama-batched-bench runs it) and returns end-to-end tokens/s (prefill included) and the
first sequence's token ids.
"""

from __future__ import annotations

import os
import time


def available() -> str | None:
    """llama-cpp-python's version, or None when it is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp.__version__


class Peer:
    """One loaded model; contexts are made per batch size."""

    def __init__(self, path: str, threads: int | None = None):
        import llama_cpp as L

        self.L, self.threads = L, threads or os.cpu_count() or 1
        self._quiet = L.llama_log_callback(lambda level, text, data: None)  # kept alive here
        L.llama_log_set(self._quiet, None)
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(str(path).encode(),
                                                  L.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)

    def decode(self, prompt: list[int], batch: int, tokens: int, repeats: int = 3
               ) -> tuple[float, list[int]]:
        """(median end-to-end tokens/s over `repeats` after a warm-up, greedy ids of sequence 0)."""
        import numpy as np

        L = self.L
        cp = L.llama_context_default_params()
        per_seq = 1 << max(7, (len(prompt) + tokens).bit_length())
        cp.n_seq_max, cp.n_ctx = batch, per_seq * batch
        cp.n_batch = cp.n_ubatch = max(512, len(prompt) * batch)
        cp.n_threads = cp.n_threads_batch = self.threads
        ctx = L.llama_init_from_model(self.model, cp)
        if not ctx:
            raise RuntimeError("llama.cpp could not make a context")
        b = L.llama_batch_init(cp.n_batch, 0, 1)

        def fill(entries):  # (token, position, sequence, wants logits)
            for k, (tok, pos, seq, logits) in enumerate(entries):
                b.token[k], b.pos[k], b.n_seq_id[k], b.logits[k] = tok, pos, 1, logits
                b.seq_id[k][0] = seq
            b.n_tokens = len(entries)

        def argmax(i):
            return int(np.argmax(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i),
                                                       shape=(self.n_vocab,))))

        def run():
            L.llama_memory_clear(L.llama_get_memory(ctx), True)
            n = len(prompt)
            fill([(t, j, s, j == n - 1) for s in range(batch) for j, t in enumerate(prompt)])
            if L.llama_decode(ctx, b):
                raise RuntimeError("llama_decode failed")
            cur = [argmax((s + 1) * n - 1) for s in range(batch)]
            first = [cur[0]]
            for step in range(tokens - 1):
                fill([(cur[s], n + step, s, True) for s in range(batch)])
                if L.llama_decode(ctx, b):
                    raise RuntimeError("llama_decode failed")
                cur = [argmax(s) for s in range(batch)]
                first.append(cur[0])
            return first

        try:
            run()  # warm-up
            rates, ids = [], []
            for _ in range(repeats):
                t = time.perf_counter()
                ids = run()
                rates.append(batch * tokens / (time.perf_counter() - t))
            return float(np.median(rates)), ids
        finally:
            L.llama_batch_free(b)
            L.llama_free(ctx)

    def close(self) -> None:
        self.L.llama_model_free(self.model)
