"""The engine: owns params, cache and the step function; runs the continuous-batching loop.

Each `step()`: the scheduler plans (host, numpy), the jitted step runs the model and samples on
the device, one packed array comes back, the scheduler updates, and per-request text is
detokenized incrementally with stop strings held back so they never stream.

Asynchronous scheduling (default; not with speculative decoding or several hosts): `step()`
plans and launches step n+1 first, its decode rows fed on the device from step n's sampled
tokens, then waits for step n's results (copied to the host as soon as it ends) and applies them,
so planning, launch and detokenization overlap the device's work. The price: a sequence that
samples a stop token (or matches a stop string) has one step planned past its end, whose result
is dropped.
"""

from __future__ import annotations

import itertools
import os
import logging
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.runtime.device.attention import resolve_backend
from jaxinfer.runtime.config import MIN_TOKEN_BUCKET, EngineConfig, ModelConfig
from jaxinfer.runtime.device.fused_projections import fuse_projections
from jaxinfer.runtime.host.errors import RequestError
from jaxinfer.runtime.host.requests import Limits, SamplingParams, check_request
from jaxinfer.runtime.device.kv_cache import init_cache
from jaxinfer.runtime.device.model import Params
from jaxinfer.runtime.plan import STEP_GROUPS, padding_arrays, pow_buckets, verify_inputs
from jaxinfer.runtime.host.scheduler import Request, Scheduler
from jaxinfer.runtime.device.steps import make_step, sampled_tokens
from jaxinfer.runtime.host.structured import Constraints, Grammars
from jaxinfer.runtime.host.tokenizer import IncrementalDetokenizer, Tokenizer
from jaxinfer.runtime.device.weight_layout import (cpu_pieces, output_major_layers,
                                            use_output_major)

log = logging.getLogger(__name__)


@dataclass
class RequestMetrics:
    arrival: float
    scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    speculative: bool = False  # report the spec_* figures below
    spec_proposed: int = 0  # proposals verified
    spec_accepted: int = 0  # proposals accepted
    spec_steps: int = 0  # verify steps with at least one proposal

    def summary(self) -> dict:
        itl = list(np.diff(self.token_times)) if len(self.token_times) > 1 else []
        return {
            "queue_s": None if self.scheduled is None else self.scheduled - self.arrival,
            "ttft_s": None if self.first_token is None else self.first_token - self.arrival,
            "itl_s": [float(x) for x in itl],
            "itl_s_mean": float(np.mean(itl)) if itl else None,
            "e2e_s": None if self.finished is None else self.finished - self.arrival,
            "cached_tokens": self.cached_tokens,
        } | (self._spec_summary() if self.speculative else {})

    def _spec_summary(self) -> dict:
        """acceptance_rate = accepted / proposed; mean_accepted_len = tokens emitted per verify
        step with proposals (accepted + the correction/bonus token), as vLLM reports it."""
        p, a, n = self.spec_proposed, self.spec_accepted, self.spec_steps
        return {"spec_proposed": p, "spec_accepted": a,
                "acceptance_rate": a / p if p else None,
                "mean_accepted_len": (a + n) / n if n else None}


@dataclass
class RequestState:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    # params.prompt_logprobs: one per prompt token, filled as its prefill steps come back (the
    # first stays None: nothing predicts it)
    prompt_logprobs: list[dict | None] = field(default_factory=list)
    text: str = ""  # full text so far (stop strings cut)
    emitted: int = 0  # chars of `text` already streamed
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # why a failed step ended it (finish_reason "error")
    lora: str | None = None  # the LoRA adapter's name (None: the base model)


@dataclass
class Delta:
    """What one step added to one request (streaming unit)."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None


def _floor(value: int | None, env: str, default: int) -> int:
    """A bucket floor: the config field, else env ENV (an integer >= 1), else `default`."""
    if value is not None:
        return value
    raw = os.environ.get(env)
    if raw:
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"{env} must be an integer >= 1, got {raw!r}")
        return int(raw)
    return default


def min_token_bucket(ecfg: EngineConfig) -> int:
    """ecfg.min_token_bucket, else env JAXINFER_MIN_TOKEN_BUCKET, else the platform's."""
    return _floor(ecfg.min_token_bucket, "JAXINFER_MIN_TOKEN_BUCKET",
                  MIN_TOKEN_BUCKET.get(jax.default_backend(), 1))


def page_buckets(ecfg: EngineConfig, max_pages: int, backend: str = "xla") -> tuple[int, ...]:
    """Page-table widths up to `max_pages`: powers of 4 from ecfg.min_page_bucket (else env
    JAXINFER_MIN_PAGE_BUCKET, else the backend's), the last one `max_pages`; each width is a
    program. The XLA attention path reads only the chunks of pages its sequences fill, whatever
    the width, so it takes one width (fewer programs to compile); the Pallas kernels walk the
    table, so short sequences get narrow ones (from 1)."""
    default = max_pages if backend == "xla" else 1
    lo = min(_floor(ecfg.min_page_bucket, "JAXINFER_MIN_PAGE_BUCKET", default), max_pages)
    return pow_buckets(lo, max_pages, 4, cap=True)


class Engine:
    def __init__(self, cfg: ModelConfig, params: Params, tokenizer: Tokenizer, ecfg: EngineConfig,
                 mesh=None, draft_model=None):
        self.adapters = None  # runtime.adapters.Adapters with enable_lora
        loaded = params
        if ecfg.enable_lora:
            params = self._init_lora(cfg, params, ecfg)
        self.cfg, self.params, self.tokenizer, self.ecfg = cfg, params, tokenizer, ecfg
        self.backend = resolve_backend(ecfg.attention_backend)
        dtype = jnp.bfloat16 if ecfg.dtype == "bfloat16" else jnp.float32
        kv_dtype = "int8" if ecfg.kv_cache_dtype == "int8" else dtype
        # tensor parallel: params and page pools live in shards on a ("data", "model") mesh
        self.mesh = mesh
        if mesh is None and (ecfg.tensor_parallel > 1 or jax.process_count() > 1):
            from jaxinfer.runtime.device.sharding import make_mesh

            self.mesh = make_mesh(ecfg.tensor_parallel)
        output_major = self.mesh is None and use_output_major(ecfg.weight_layout,
                                                              jax.default_backend())
        fuse = ecfg.fuse_projections
        if fuse or (fuse is None and not output_major):
            # one QKV and one gate/up weight (runtime/device/fused_projections.py)
            tp = 1 if self.mesh is None else self.mesh.shape["model"]
            params = self.params = fuse_projections(params, tp)
        make_cache = lambda: init_cache(cfg, ecfg.total_pages, ecfg.page_size, kv_dtype)  # noqa: E731
        if self.mesh is None:
            self._new_cache = make_cache
        else:
            from jaxinfer.runtime.device.sharding import init_sharded_cache, shard_params

            self.params = shard_params(params, self.mesh)
            self._new_cache = lambda: init_sharded_cache(make_cache, self.mesh)  # noqa: E731
        if output_major:
            # layer weights stored [out, in], a piece per core (runtime/device/weight_layout.py). Not
            # when split over host devices: the mixed workload measured 282 vs 288 tok/s there
            self.params = output_major_layers(self.params, cpu_pieces())
        if draft_model is not None and draft_model[1] is loaded:  # the target drafts itself
            draft_model = (draft_model[0], self.params)
        self.cache = self._new_cache()
        # ids the tokenizer can decode: a vocabulary padded past the tokenizer's (Qwen2.5: 151936
        # rows, 151665 tokens) never samples the padding rows
        self.text_vocab = min(tokenizer.vocab_size, cfg.vocab_size)
        self.eos_ids = tuple(tokenizer.eos_ids) or tuple(cfg.eos_token_ids)
        # structured output: grammars over the served vocabulary, masks of W int32 words a row
        self.grammars = Grammars.of(tokenizer, cfg.vocab_size, self.eos_ids)
        self.constraints = Constraints(self.grammars) if self.grammars else None
        self.spec = ecfg.speculative
        k = self.spec.k if self.spec else 0
        # a full decode batch (with k proposals per row) always fits
        budget = max(ecfg.prefill_chunk, ecfg.max_slots * (1 + k))
        tokens = pow_buckets(min(min_token_bucket(ecfg), budget), budget, cap=True)
        pages = page_buckets(ecfg, ecfg.pages_per_seq, self.backend)
        self.scheduler = Scheduler(
            max_slots=ecfg.max_slots, num_pages=ecfg.total_pages, page_size=ecfg.page_size,
            max_model_len=ecfg.max_model_len, token_budget=budget, token_buckets=tokens,
            # q_len bucket: 1 for decode-only steps, else the token bucket (cap) -> few compiles;
            # k + 1 for verify-only steps under speculation
            q_buckets=tuple(sorted({1, tokens[-1]} | ({min(k + 1, tokens[-1])} if k else set()))),
            page_buckets=pages, enable_prefix_caching=ecfg.enable_prefix_caching,
            num_spec_tokens=k, mask_words=self.grammars.words if self.grammars else 1,
            max_loras=ecfg.max_loras if ecfg.enable_lora else 0, slo=ecfg.slo,
        )
        self.proposer, self._verify = None, None
        if self.spec is not None:
            self._init_speculative(draft_model, kv_dtype, budget)
        shardings, self.plan_channel, self.leader = None, None, jax.process_index() == 0
        if self.mesh is not None:
            from jaxinfer.runtime.device import sharding as shd

            if self.mesh.shape["model"] > 1 and self.backend in ("pallas_tpu", "pallas_gpu"):
                # Mosaic / Triton kernels are not auto-partitioned by XLA SPMD (they need a
                # shard_map over the kv-head axis, not wired yet): serve TP with the XLA path
                if ecfg.attention_backend == "pallas":
                    raise ValueError("attention_backend='pallas' with tensor_parallel > 1 is not "
                                     "supported yet; use 'xla' (or leave it unset)")
                self.backend = "xla"

            shardings = (shd.param_shardings(self.params, self.mesh),
                         shd.cache_shardings(self.cache, self.mesh), shd.replicated(self.mesh))
            if jax.process_count() > 1:  # multi-host: process 0 schedules and broadcasts plans
                from jaxinfer.runtime.device.distributed import PlanChannel, PlanCodec

                self.plan_channel = PlanChannel(
                    PlanCodec(tokens[-1], ecfg.max_slots, pages[-1], self.scheduler.mask_words))
        self._step = make_step(cfg, self.backend, shardings, vocab_limit=self.text_vocab)
        self._inflight = None  # (plan, packed, sampled tokens) of the launched, unapplied step
        self._no_prev = None  # zeros [S]: `prev` of a step launched with nothing in flight
        # step(): calls, seconds inside, seconds of those blocked on the device's results
        # (step_s - wait_s = host time the device did not hide)
        self.step_stats = dict(steps=0, step_s=0.0, wait_s=0.0)
        self._timed = None  # the plan whose results the current step() call waited for
        self._period = None  # (start, plan) of the last call, while the caller has more work
        self.requests: dict[str, RequestState] = {}
        self._ids = itertools.count()
        self._zero_masks = {}  # shape -> device zeros: the bitmasks of steps with no constraint
        self.limits = Limits.of(self)
        self.faults = 0  # steps that raised (their requests failed, the engine went on)
        self.spec_proposed = 0  # proposals verified, all requests since start
        self.spec_accepted = 0  # of those, accepted
        self.consecutive_faults = 0  # ... since the last step that did not

    @property
    def async_scheduling(self) -> bool:
        """Plan one step ahead: on unless configured off, speculating (proposals need every
        token known) or broadcasting plans to other hosts (they replay plans as sent)."""
        return (self.ecfg.async_scheduling and self.proposer is None
                and self.plan_channel is None)

    def _init_speculative(self, draft_model, kv_dtype, budget) -> None:
        from jaxinfer.runtime.proposers import DraftModelProposer, NgramProposer, check_vocab
        from jaxinfer.runtime.device.steps import make_verify

        if self.mesh is not None:
            raise ValueError("speculative decoding with tensor_parallel > 1 is not supported yet")
        sp, e = self.spec, self.ecfg
        if sp.method == "ngram":
            self.proposer = NgramProposer(sp.k, sp.n)
        else:
            if draft_model is None:
                raise ValueError("speculative method 'draft' needs the draft model (cfg, params)")
            dcfg, dparams = draft_model
            check_vocab(self.cfg, dcfg, repr(sp.model))
            extra = e.max_slots * (-(-sp.k // e.page_size) + 1)  # proposals past max_model_len
            self.proposer = DraftModelProposer(
                dcfg, dparams, k=sp.k, max_slots=e.max_slots, page_size=e.page_size,
                num_pages=e.total_pages + extra, token_budget=budget, backend=self.backend,
                # a shadow holds up to k proposals past max_model_len
                page_buckets=page_buckets(e, -(-(e.max_model_len + sp.k) // e.page_size),
                                         self.backend),
                dtype=kv_dtype)
        self._verify = make_verify(self.cfg, self.backend, vocab_limit=self.text_vocab)

    # ---- requests -------------------------------------------------------------------------
    # ---- LoRA adapters -------------------------------------------------------------------
    def _init_lora(self, cfg: ModelConfig, params: Params, ecfg: EngineConfig) -> Params:
        from jaxinfer.runtime.adapters import Adapters
        from jaxinfer.runtime.device.lora import init_lora

        if jax.process_count() > 1:
            raise ValueError("LoRA adapters with several hosts are not supported yet")
        self.adapters = Adapters(cfg, ecfg.max_lora_rank, ecfg.max_cpu_loras)
        return params.replace(lora=init_lora(cfg, ecfg.max_loras, ecfg.max_lora_rank))

    def add_lora(self, name: str, path: str):
        """Register the PEFT adapter at `path` as `name` (read and checked now); -> Adapter."""
        if self.adapters is None:
            raise ValueError("this engine serves no LoRA adapters (enable_lora=False)")
        return self.adapters.add(name, path)

    def remove_lora(self, name: str) -> None:
        """Unload `name`; refused (ValueError) while an unfinished request uses it."""
        a = self.adapters.get(name) if self.adapters is not None else None
        if a is None:
            raise ValueError(f"unknown LoRA adapter {name!r}")
        users = sum(1 for st in self.requests.values() if st.lora == name and not st.finished)
        if users:
            raise ValueError(f"LoRA adapter {name!r} is in use by {users} unfinished request(s)")
        self.scheduler.lora_slots.evict(a.key)
        self.adapters.remove(name)

    def lora_key(self, name: str | None) -> str | None:
        """The scheduler's key of adapter `name` (None: none); RequestError (field "lora") if
        the engine serves no adapters or none of that name."""
        if name is None:
            return None
        if self.adapters is None:
            raise RequestError("lora", "this engine serves no LoRA adapters (start it with "
                                       "enable_lora=True)")
        a = self.adapters.get(name) if isinstance(name, str) else None
        if a is None:
            raise RequestError("lora", f"unknown LoRA adapter {name!r}; loaded: "
                                       f"{self.adapters.names()}")
        return a.key

    def _load_lora_slots(self, loads: list[tuple[int, str]]) -> None:
        """Copy the adapters the plan's new rows use into their device slots."""
        from jaxinfer.runtime.device.lora import write_slot

        old = stack = self.params.lora
        for slot, key in loads:
            stack = write_slot(stack, np.int32(slot), self.adapters.weights(key))
        if self.mesh is not None:  # keep the slots' layout: the step programs expect it
            stack = jax.tree.map(lambda new, o: jax.device_put(new, o.sharding), stack, old)
        self.params = self.params.replace(lora=stack)

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, lora: str | None = None,
                    refuse_late: bool = True) -> str:
        """Queue a request (checked by the request door again: nothing unchecked reaches a
        step), with the LoRA adapter named `lora` (None: the base model). Raises RequestError
        naming the field; scheduler.Overloaded when the engine refuses late requests
        (refuse_late=False: the caller checked already)."""
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"duplicate request_id {rid!r}")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        prompt_ids = [int(t) for t in prompt_ids]
        check_request(prompt_ids, params, self.limits)
        key = self.lora_key(lora)
        if refuse_late:
            self.scheduler.check_overload(rid, len(prompt_ids), params.priority)
        now = time.monotonic()
        req = Request(request_id=rid, prompt_ids=prompt_ids, params=params, eos_ids=self.eos_ids,
                      arrival_time=now, lora=key)
        if params.structured_outputs is not None:  # scheduled once its matcher is built
            self.constraints.hold(req, params.structured_outputs)
        else:
            self.scheduler.add_request(req)
        self.requests[rid] = RequestState(
            request_id=rid, prompt_ids=prompt_ids, params=params,
            detok=IncrementalDetokenizer(self.tokenizer, prompt_ids),
            metrics=RequestMetrics(arrival=now, speculative=self.spec is not None),
            prompt_logprobs=[None] * len(prompt_ids) if params.prompt_logprobs is not None else [],
            lora=lora,
        )
        return rid

    def abort(self, request_id: str) -> bool:
        st = self.requests.get(request_id)
        if st is None or st.finished:
            return False
        if self.constraints is None or request_id not in self.constraints.held:
            self.scheduler.abort(request_id)
        self._finish(st, "abort", time.monotonic())
        return True

    @property
    def has_work(self) -> bool:
        """Something for step() to do: scheduled work, or requests whose grammar is compiling."""
        return self.scheduler.has_work or bool(self.constraints and self.constraints.held)

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: the scheduler's queue and those whose grammar compiles."""
        return self.scheduler.num_waiting + (len(self.constraints.held) if self.constraints else 0)

    def has_unfinished(self) -> bool:
        return any(not s.finished for s in self.requests.values())

    def pop(self, request_id: str) -> RequestState:
        return self.requests.pop(request_id)

    @property
    def compile_count(self) -> int:
        """Distinct programs this engine has launched (steps.Launches): the step, and under
        speculation the verify step and the draft model's step. Engines of one model in one
        process share their compiled programs, so a program may have been compiled by another."""
        n = self._step.count + (self._verify.count if self._verify is not None else 0)
        return n + (self.proposer.compile_count if self.proposer is not None else 0)

    def warmup(self, logprobs: bool = False, filtered: bool = False) -> int:
        """Compile every step shape the scheduler can emit (token x page x q_len buckets; q_len
        1 only for steps small enough to be decode-only) with all-padding plans; under
        speculation also the verify step (no proposer distributions: greedy, n-gram) and the
        draft model's steps. Returns the number of new compilations."""
        from jaxinfer.runtime.host.scheduler import LOGPROBS_BUCKET

        before = self.compile_count
        sch, s = self.scheduler, self.ecfg.max_slots
        decode_t = min(b for b in sch.token_buckets if b >= s)
        n_lp = LOGPROBS_BUCKET if logprobs else 0
        groups = STEP_GROUPS + ("feed",) if self.async_scheduling else STEP_GROUPS
        w = sch.mask_words
        for t in sch.token_buckets:
            qs = {min(b, t) for b in sch.q_buckets if b > 1} | ({1} if t <= decode_t else set())
            for p in sch.page_buckets:
                plan = padding_arrays(groups, T=t, S=s, P=p, W=w)
                for q in sorted(qs):
                    self.cache = self._run(plan, q, logprobs, filtered, prev=self._prev())[1]
                    if self._verify is not None and q > 1:  # a verify row has 1 + d > 1 tokens
                        arrays = verify_inputs(padding_arrays(
                            STEP_GROUPS + ("speculative",), T=t, S=s, P=p, K=self.spec.k, W=w))
                        self.cache = self._verify(
                            self.params, self.cache, self._device_masks(arrays), None,
                            np.zeros(s, np.int32),
                            max_q_len=q, num_logprobs=n_lp, filtered=filtered)[1]
        if self.proposer is not None:
            self.proposer.warmup()
        return self.compile_count - before

    def _prev(self):
        """`prev` for the next launch: the in-flight step's sampled tokens (None when not
        scheduling asynchronously)."""
        if not self.async_scheduling:
            return None
        if self._inflight is not None:
            return self._inflight[2]
        if self._no_prev is None:
            self._no_prev = jnp.zeros(self.ecfg.max_slots, jnp.int32)
            if self.mesh is not None:
                from jaxinfer.runtime.device.sharding import replicated

                self._no_prev = jax.device_put(self._no_prev, replicated(self.mesh))
        return self._no_prev

    def _run(self, arrays, max_q_len, logprobs, filtered, prev=None):
        """Launch the step on a plan's arrays. Rows scoring prompt tokens (prompt_targets >= 0)
        select the step's prompt-logprob program, whose output is (packed, prompt rows)."""
        from jaxinfer.runtime.host.scheduler import LOGPROBS_BUCKET

        prompt = bool((np.asarray(arrays["prompt_targets"]) >= 0).any())

        if self.plan_channel is not None and self.leader:  # followers run the same step
            self.plan_channel.send(arrays, max_q_len, LOGPROBS_BUCKET if logprobs else 0, filtered)
        if self.mesh is not None and jax.process_count() > 1:
            from jaxinfer.runtime.device.distributed import global_plan

            arrays = global_plan(arrays, self.mesh)
        elif self.mesh is None:
            arrays = self._device_masks(arrays)
        return self._step(self.params, self.cache, arrays, max_q_len=max_q_len,
                          num_logprobs=LOGPROBS_BUCKET if logprobs else 0, filtered=filtered,
                          prompt_logprobs=prompt, prev=prev)

    def _device_masks(self, arrays: dict) -> dict:
        """The plan's token masks (token_bitmask, and draft_bitmask of a verify step) as device
        arrays: the device's zeros when no row is constrained, not [S, (K,) W] words from the
        host each step (both device arrays, so the two are one program)."""
        names = [k for k in ("token_bitmask", "draft_bitmask") if k in arrays]
        if arrays["constrained"].any():
            return {**arrays, **{k: jax.device_put(arrays[k]) for k in names}}
        out = dict(arrays)
        for k in names:
            shape = arrays[k].shape
            if shape not in self._zero_masks:
                self._zero_masks[shape] = jnp.zeros(shape, jnp.int32)
            out[k] = self._zero_masks[shape]
        return out

    def release_followers(self) -> None:
        """Multi-host leader: tell the follower processes (in `follow`) to stop."""
        if self.plan_channel is not None and self.leader:
            self.plan_channel.send_stop()

    def follow(self) -> int:
        """A follower process's loop: run every step the leader broadcasts, until it sends stop.
        Returns the number of steps run."""
        n = 0
        while True:
            msg = self.plan_channel.recv()
            if msg is None:
                return n
            arrays, max_q_len, num_logprobs, filtered = msg
            self.cache = self._run(arrays, max_q_len, num_logprobs > 0, filtered)[1]
            n += 1

    # ---- the loop -------------------------------------------------------------------------
    def step(self) -> list[Delta]:
        """One engine step. A step that raises fails the requests it may have touched (finish
        reason "error", slots and pages freed) and the engine goes on with the rest."""
        t0 = time.perf_counter()
        if self._period is not None:  # the last call's plan, timed start to start
            start, plan = self._period
            self._record_step_time(plan, t0 - start)
        self._period = None
        self._timed = None  # the plan this call waits for (async: the one launched before)
        try:
            programs = self.compile_count
            deltas = self._admit_constrained() if self.constraints and self.constraints.held else []
            deltas += self._step_async() if self.async_scheduling else self._step_sync()
            self.consecutive_faults = 0
            if self._timed is not None and self.compile_count == programs:  # (no compile)
                if self.scheduler.has_work:  # the caller comes straight back: time its period
                    self._period = (t0, self._timed)
                else:
                    self._record_step_time(self._timed, time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 - a request may fail; the engine may not
            deltas = self._recover(exc)
        st = self.step_stats
        st["steps"] += 1
        st["step_s"] += time.perf_counter() - t0
        return deltas

    def _recover(self, exc: Exception) -> list[Delta]:
        """After a failed step: every request that held a slot (all rows of the failed and the
        in-flight plan) fails with finish reason "error"; waiting requests stay queued. A cache
        the failed step consumed (donated) is rebuilt empty, with the prefix cache dropped."""
        log.error("engine step failed; failing the running requests", exc_info=exc)
        self.faults += 1
        self.consecutive_faults += 1
        self._inflight = None
        failed = self.scheduler.fail_running()
        if self.constraints is not None:  # held requests may be what failed: fail them too
            failed += list(self.constraints.held)
        if any(x.is_deleted() for x in jax.tree.leaves(self.cache)):
            self.cache = self._new_cache()
            self.scheduler.reset_prefix_cache()
        now, why = time.monotonic(), f"engine step failed: {type(exc).__name__}: {exc}"
        deltas = []
        for rid in failed:
            st = self.requests.get(rid)
            if st is None or st.finished:
                continue
            st.error = why
            self._finish(st, "error", now)
            deltas.append(Delta(rid, "", [], True, "error"))
        return deltas

    def _admit_constrained(self) -> list[Delta]:
        """Schedule held requests whose matcher is built (when nothing else can run, wait a
        little for one); a matcher that failed fails its request."""
        idle = not self.scheduler.has_work and self._inflight is None
        deltas, now = [], time.monotonic()
        for req, why in self.constraints.ready(wait_s=0.05 if idle else 0.0):
            st = self.requests.get(req.request_id)
            if st is None or st.finished:
                self.constraints.drop(req.request_id)
            elif why is None:
                self.scheduler.add_request(req)
            else:
                st.error = why
                self._finish(st, "error", now)
                deltas.append(Delta(req.request_id, "", [], True, "error"))
        return deltas

    def _schedule(self):
        """The next plan, with its constrained rows' token masks filled."""
        plan = self.scheduler.schedule()
        if plan is not None and plan.lora_loads:
            self._load_lora_slots(plan.lora_loads)
        if plan is not None and self.constraints is not None and plan.constrained.any():
            self.constraints.fill(plan)
        return plan

    def _fetch(self, packed) -> tuple[np.ndarray, np.ndarray | None]:
        """The step's packed results on the host (blocks until the step has run), and its
        prompt-logprob rows (None when it scored no prompt)."""
        t0 = time.perf_counter()
        host = jax.device_get(packed)
        self.step_stats["wait_s"] += time.perf_counter() - t0
        if isinstance(host, tuple):
            return np.asarray(host[0]), np.asarray(host[1])
        return np.asarray(host), None

    def _step_sync(self) -> list[Delta]:
        props = None
        if self.proposer is not None:  # proposals first: they set how many tokens rows want
            cands = self.scheduler.decode_candidates()
            props = self.proposer.propose(cands) if cands else None
            self.scheduler.set_drafts(props.tokens if props is not None else {})
        plan = self._schedule()
        if plan is None:
            return []
        filtered = _filtered(plan)
        if plan.has_drafts:
            return self._verify_step(plan, props, filtered)
        packed, self.cache = self._run(plan.device_arrays(), plan.max_q_len,
                                       plan.num_logprobs > 0, filtered)
        host, prompt = self._fetch(packed)  # [S, 1 (+ 1 + 2n)], [T, 1 + 2n] or None
        now = self._mark_scheduled(plan)
        return self._apply(plan, host, self.scheduler.update(plan, host[:, 0].astype(np.int32)),
                           now, prompt)

    def _step_async(self) -> list[Delta]:
        """Launch the next step (fed from the one in flight), then apply the one in flight. A
        step in flight with constrained rows is applied first: their next masks need its tokens."""
        if self._inflight is not None and self.constraints and self.constraints.any_in(self._inflight[0]):
            done, self._inflight = self._inflight, None
            return self._apply_launched(done)
        plan = self._schedule()
        launched = None
        if plan is not None:
            arrays = plan.device_arrays(feed=True)
            packed, self.cache = self._run(arrays, plan.max_q_len, plan.num_logprobs > 0,
                                           _filtered(plan), prev=self._prev())
            for x in jax.tree.leaves(packed):
                x.copy_to_host_async()
            launched = (plan, packed, sampled_tokens(packed))
            self._mark_scheduled(plan)
        done, self._inflight = self._inflight, launched
        return [] if done is None else self._apply_launched(done)

    def _apply_launched(self, done) -> list[Delta]:
        plan, packed, _ = done
        host, prompt = self._fetch(packed)  # [S, 1 (+ 1 + 2n)], [T, 1 + 2n] or None
        now = time.monotonic()
        return self._apply(plan, host, self.scheduler.update(plan, host[:, 0].astype(np.int32)),
                           now, prompt)

    def _verify_step(self, plan, props, filtered) -> list[Delta]:
        """Target forward over every row's last token + proposals, acceptance on the device."""
        K = plan.spec_k
        assert not plan.prompt_logprobs, "the scheduler plans no proposals beside prompt scoring"
        q_rows = np.zeros(len(plan.kv_lens), np.int32)
        q_probs = None
        if props is not None and props.q_probs is not None:
            q_probs = props.q_probs
            for s, rid in enumerate(plan.request_ids):
                q_rows[s] = props.q_rows.get(rid, 0)
        packed, self.cache = self._verify(
            self.params, self.cache, self._device_masks(plan.verify_arrays()), q_probs, q_rows,
            max_q_len=plan.max_q_len, num_logprobs=plan.num_logprobs, filtered=filtered)
        host, _ = self._fetch(packed)  # [S, 2 + K (+ 1 + 2n)]
        now = self._mark_scheduled(plan)
        outs = self.scheduler.update(plan, host[:, 1:K + 2].astype(np.int32),
                                     host[:, 0].astype(np.int32))
        # logprob columns laid out as the plain step's: [token, chosen, top vals, top ids]
        return self._apply(plan, host[:, K + 1:], outs, now)

    def _mark_scheduled(self, plan) -> float:
        """Stamp first-scheduled time and prefix-cache hits (before update() retires anyone)."""
        now = time.monotonic()
        for rid in plan.request_ids:
            st = self.requests.get(rid)
            if st is not None and st.metrics.scheduled is None:
                st.metrics.scheduled = now
                st.metrics.cached_tokens = self.scheduler.cached_tokens_of(rid)
        return now

    def _record_step_time(self, plan, seconds: float) -> None:
        """What the latency targets predict from: the seconds from one step() call to the next
        (what a streaming client sees between tokens: the step and the caller's own work), by
        the token rows of the plan the call waited for (with async scheduling the device runs
        plans back to back, so a call lasts about the device time of the plan launched before
        it), and by live sequences when every one decodes."""
        sched = self.scheduler
        sched.step_times.record(len(plan.token_ids), seconds)
        n = int(plan.num_seqs[0])
        if plan.num_tokens == n:
            sched.decode_times.record(n, seconds)

    def _apply(self, plan, host, outputs, now, prompt=None) -> list[Delta]:
        self._timed = plan
        if prompt is not None:  # before the tokens: a first token streams with its prompt's
            self._record_prompt_logprobs(plan, prompt)
        row_of = {rid: s for s, rid in enumerate(plan.request_ids)}
        deltas = []
        for out in outputs:
            st = self.requests.get(out.request_id)
            if st is None or st.finished:
                continue
            if out.num_proposed:
                m = st.metrics
                m.spec_proposed += out.num_proposed
                m.spec_accepted += out.num_accepted
                m.spec_steps += 1
                self.spec_proposed += out.num_proposed
                self.spec_accepted += out.num_accepted
            row = host[row_of[out.request_id]]
            finished, reason = out.finished, out.finish_reason
            if self.constraints is not None and out.request_id in self.constraints.live:
                ended, why = self.constraints.advance(out.request_id, out.new_token_ids)
                if ended is not None and not finished:
                    self.scheduler.finish(out.request_id, ended)
                    finished, reason, st.error = True, ended, why or None
            deltas.append(self._consume(st, out.new_token_ids, finished, reason,
                                        row, plan.num_logprobs, now))
        return deltas

    def _consume(self, st: RequestState, new_ids, finished, reason, row, n_lp, now) -> Delta:
        stop_at = None  # several tokens in one step: none after a completed stop string
        for idx, tok in enumerate(new_ids):
            st.token_ids.append(tok)
            st.metrics.token_times.append(now)
            if st.metrics.first_token is None:
                st.metrics.first_token = now
            if st.params.logprobs is not None and n_lp:
                st.logprobs.append(_logprob_entry(tok, row[1:], n_lp, st.params.logprobs))
            st.text += st.detok.add(tok)
            if len(new_ids) > 1 and st.params.stop and idx + 1 < len(new_ids) and _find_stop(
                    st.text, st.params.stop, max(0, st.emitted - _max_len(st.params.stop))) is not None:
                stop_at = idx + 1
                break
        if stop_at is not None:
            new_ids = new_ids[:stop_at]
        if finished:
            st.text += st.detok.flush()
        cut = _find_stop(st.text, st.params.stop, max(0, st.emitted - _max_len(st.params.stop)))
        if cut is not None:
            st.text = st.text[:cut]
            if not finished:
                self.scheduler.finish(st.request_id, "stop")
            finished, reason = True, "stop"
        if finished:
            self._finish(st, reason, now)
            upto = len(st.text)
        else:
            upto = len(st.text) - _holdback(st.text, st.params.stop)
        delta = st.text[st.emitted:upto]
        st.emitted = max(st.emitted, upto)
        return Delta(st.request_id, delta, list(new_ids), finished, st.finish_reason)

    def _record_prompt_logprobs(self, plan, rows: np.ndarray) -> None:
        """rows [T, 1 + 2n]: token row t scores prompt token prompt_targets[t], at position
        positions[t] + 1, of the request of its sequence row (a recomputed prefill after
        preemption writes the same values again)."""
        n, cu = plan.num_logprobs, plan.cu_q_lens
        for s, rid in enumerate(plan.request_ids):
            st = self.requests.get(rid)
            if st is None or st.finished or st.params.prompt_logprobs is None:
                continue
            k = st.params.prompt_logprobs
            for t in range(int(cu[s]), int(cu[s + 1])):
                target = int(plan.prompt_targets[t])
                if target >= 0:
                    st.prompt_logprobs[int(plan.positions[t]) + 1] = _logprob_entry(
                        target, rows[t], n, k)

    def _finish(self, st: RequestState, reason: str | None, now: float) -> None:
        if self.proposer is not None:
            self.proposer.release(st.request_id)
        if self.constraints is not None:
            self.constraints.drop(st.request_id)
        st.finished, st.finish_reason = True, reason
        st.metrics.finished = now


def _logprob_entry(token: int, cols: np.ndarray, n: int, k: int) -> dict:
    """cols [1 + 2n]: the token's logprob, the top-n logprobs, their ids -> the entry of a
    token with its top k <= n."""
    return {"token_id": int(token), "logprob": float(cols[0]),
            "top": [(int(i), float(v)) for v, i in zip(cols[1:1 + k], cols[1 + n:1 + n + k])]}


def _filtered(plan) -> bool:
    """Whether any live row samples with top-k / top-p / min-p (a static flag of the step)."""
    live = slice(0, int(plan.num_seqs[0]))
    return bool(np.any(
        (plan.temperature[live] > 0)
        & ((plan.top_k[live] > 0) | (plan.top_p[live] < 1) | (plan.min_p[live] > 0))
    ))


def _max_len(stops) -> int:
    return max((len(s) for s in stops), default=0)


def _find_stop(text: str, stops, start: int) -> int | None:
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _holdback(text: str, stops) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
