"""The engine: runs the continuous-batching loop over a prepared model.

Each `step()`: the scheduler plans (host, numpy), the jitted step runs the model and samples on
the device, one packed array comes back, the scheduler updates, and the output processor
(runtime/host/outputs.py) turns the new tokens into one RequestDelta per request. The model
arrives prepared (runtime/build.py: fused, laid out, sharded, with its LoRA stack); the engine
builds its cache, scheduler, grammars, proposer and step programs around it. Front ends see it
through runtime/host/interface.py and nothing else.

Asynchronous scheduling (default; not with speculative decoding or several hosts): `step()`
plans and launches step n+1 first, its decode rows fed on the device from step n's sampled
tokens, then waits for step n's results (copied to the host as soon as it ends) and applies them,
so planning, launch and detokenization overlap the device's work. The price: a sequence that
samples a stop token (or matches a stop string) has one step planned past its end, whose result
is dropped.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.runtime.build import Prepared
from jaxinfer.runtime.config import (COMPILE_MODES, MIN_TOKEN_BUCKET, UPDATE_POLICIES, EngineConfig,
                                     OptionError)
from jaxinfer.runtime.device.kv_cache import init_cache
from jaxinfer.runtime.device.kv_offload import HostPages, gather_pages, padded, scatter_pages
from jaxinfer.runtime.device.processors import init_state, write_slot
from jaxinfer.runtime.device.programs import StepPrograms
from jaxinfer.runtime.device.steps import make_step, sampled_tokens
from jaxinfer.runtime.host.admission import admission_policy
from jaxinfer.runtime.host.errors import AdapterInUse, EngineAsleep, RequestError, UnknownAdapter
from jaxinfer.runtime.host.image_prompt import ImageDoor, expand, mrope_positions
from jaxinfer.runtime.host.kv_host_tier import HostTier
from jaxinfer.runtime.host.outputs import OutputProcessor, RequestDelta, RequestOutput
from jaxinfer.runtime.host.requests import Limits, SamplingParams, check_request, truncate_prompt
from jaxinfer.runtime.host.plan_rows import LOGPROBS_BUCKET
from jaxinfer.runtime.host.processors import Dims, ProcessorSpec, processor_fields
from jaxinfer.runtime.host.scheduler import Request, Scheduler
from jaxinfer.runtime.host.structured import Constraints, Grammars
from jaxinfer.runtime.plan import STEP_GROUPS, padding_arrays, pow_buckets, verify_inputs
from jaxinfer.runtime.weights import (delete, device_bytes, from_host, loaded_form, rebuild,
                                      to_host)

log = logging.getLogger(__name__)


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


def compile_mode(ecfg: EngineConfig) -> str:
    """ecfg.compile_mode, else env JAXINFER_COMPILE_MODE, else "background"; always "blocking"
    under batch_invariant (the layer-by-layer programs compile with other XLA options, whose
    rounding may differ)."""
    if ecfg.batch_invariant:
        return "blocking"
    mode = ecfg.compile_mode or os.environ.get("JAXINFER_COMPILE_MODE") or "background"
    if mode not in COMPILE_MODES:
        raise ValueError(f"JAXINFER_COMPILE_MODE must be one of {COMPILE_MODES}, got {mode!r}")
    return mode


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
    if ecfg.batch_invariant:  # one width: attention's KV chunks are cut by it
        return (max_pages,)
    default = max_pages if backend == "xla" else 1
    lo = min(_floor(ecfg.min_page_bucket, "JAXINFER_MIN_PAGE_BUCKET", default), max_pages)
    return pow_buckets(lo, max_pages, 4, cap=True)


@dataclass(frozen=True)
class StepShapes:
    """The static shapes steps are padded to: each (token, page, q_len) bucket is a program."""

    budget: int  # token rows a step may carry
    tokens: tuple[int, ...]
    pages: tuple[int, ...]
    q_lens: tuple[int, ...]

    @classmethod
    def of(cls, ecfg: EngineConfig, backend: str, k: int) -> StepShapes:
        budget = max(ecfg.prefill_chunk, ecfg.max_slots * (1 + k))  # a full decode batch fits
        tokens = pow_buckets(min(min_token_bucket(ecfg), budget), budget, cap=True)
        # q_len: 1 for decode-only steps, else the token bucket (cap); k + 1 for verify-only
        # steps under speculation
        q = {1, tokens[-1]} | ({min(k + 1, tokens[-1])} if k else set())
        return cls(budget, tokens, page_buckets(ecfg, ecfg.pages_per_seq, backend),
                   tuple(sorted(q)))


class Engine:
    """Implements runtime.host.interface.EngineInterface."""

    def __init__(self, model: Prepared):
        cfg, ecfg, tokenizer = model.cfg, model.config, model.tokenizer
        self.cfg, self.params, self.tokenizer, self.ecfg = cfg, model.params, tokenizer, ecfg
        self.mesh, self.backend = model.mesh, model.backend
        self.adapters = None  # runtime.adapters.Adapters with enable_lora
        self._lora_dirs: set[str] = set()  # update_lora's temporary dirs of in-memory tensors
        if ecfg.enable_lora:
            from jaxinfer.runtime.adapters import Adapters

            self.adapters = Adapters(cfg, ecfg.max_lora_rank, ecfg.max_cpu_loras)
        dtype = jnp.bfloat16 if ecfg.dtype == "bfloat16" else jnp.float32
        kv_dtype = dtype if ecfg.kv_cache_dtype == "auto" else ecfg.kv_cache_dtype
        make_cache = lambda: init_cache(cfg, ecfg.total_pages, ecfg.page_size, kv_dtype)  # noqa: E731
        if self.mesh is None:  # committed, as every step's outputs are: one program for both
            self._new_cache = lambda: jax.device_put(make_cache(), jax.devices()[0])  # noqa: E731
        else:
            from jaxinfer.runtime.device.sharding import init_sharded_cache

            self._new_cache = lambda: init_sharded_cache(make_cache, self.mesh)  # noqa: E731
        self.cache = self._new_cache()
        self.host_kv = self._host_tier_store()  # the host tier's arrays (None: no tier)
        # logits processors (penalties, logit_bias, bans): a state row per slot, on the device
        self.proc_dims = Dims(cfg.vocab_size)
        self.procs = self._new_procs()
        # ids the tokenizer can decode: a vocabulary padded past the tokenizer's (Qwen2.5: 151936
        # rows, 151665 tokens) never samples the padding rows
        self.text_vocab = min(tokenizer.vocab_size, cfg.vocab_size)
        self.eos_ids = tuple(tokenizer.eos_ids) or tuple(cfg.eos_token_ids)
        # structured output: grammars over the served vocabulary, masks of W int32 words a row
        self.grammars = Grammars.of(tokenizer, cfg.vocab_size, self.eos_ids)
        self.constraints = Constraints(self.grammars) if self.grammars else None
        self.spec = ecfg.speculative
        k = self.spec.k if self.spec else 0
        shapes = self.shapes = StepShapes.of(ecfg, self.backend, k)
        self.scheduler = Scheduler(
            max_slots=ecfg.max_slots, num_pages=ecfg.total_pages, page_size=ecfg.page_size,
            max_model_len=ecfg.max_model_len, token_budget=shapes.budget,
            token_buckets=shapes.tokens, q_buckets=shapes.q_lens, page_buckets=shapes.pages,
            enable_prefix_caching=ecfg.enable_prefix_caching, num_spec_tokens=k,
            mask_words=self.grammars.words if self.grammars else 1,
            max_loras=ecfg.max_loras if ecfg.enable_lora else 0,
            admission=admission_policy(ecfg.slo),
            host_tier=HostTier(self.host_kv.slots) if self.host_kv is not None else None,
        )
        self.outputs = OutputProcessor(tokenizer, speculative=self.spec is not None)
        self.images = self._init_images(model.vision)  # runtime.images.Images (None: text only)
        self.proposer, self._verify = None, None
        if self.spec is not None:
            self._init_speculative(model.draft, kv_dtype, shapes.budget)
        self.plan_channel, self.leader = None, jax.process_index() == 0
        if self.mesh is None or jax.process_count() == 1:
            # body and head programs, layer by layer until compiled (on a mesh of this
            # process's devices too: the programs take their shardings from the arrays)
            self._step = StepPrograms(cfg, self.backend, self.params, self.cache,
                                      mode=compile_mode(ecfg), vocab_limit=self.text_vocab,
                                      processed_logprobs=self.processed_logprobs,
                                      token_buckets=shapes.tokens,
                                      mesh=None if self.mesh is None else self.mesh.abstract_mesh)
        else:  # several hosts: process 0 schedules, broadcasts plans; one sharded program a step
            from jaxinfer.runtime.device import sharding as shd
            from jaxinfer.runtime.device.distributed import PlanChannel, PlanCodec

            self.plan_channel = PlanChannel(PlanCodec(
                shapes.tokens[-1], ecfg.max_slots, shapes.pages[-1], self.scheduler.mask_words))
            shardings = (shd.param_shardings(self.params, self.mesh),
                         shd.cache_shardings(self.cache, self.mesh), shd.replicated(self.mesh))
            self._step = make_step(cfg, self.backend, shardings, vocab_limit=self.text_vocab,
                                   processed_logprobs=self.processed_logprobs)
        self._inflight = None  # (plan, packed, sampled tokens) of the launched, unapplied step
        self._held = None  # (plan, arrays, prev): scheduled, launched by the next step() call
        self._no_prev = None  # zeros [S]: `prev` of a step launched with nothing in flight
        # step(): calls, seconds inside, seconds of those blocked on the device's results
        # (step_s - wait_s = host time the device did not hide)
        self.step_stats = dict(steps=0, step_s=0.0, wait_s=0.0)
        self._timed = None  # the plan whose results the current step() call waited for
        self._period = None  # (start, plan) of the last call, while the caller has more work
        self._ids = itertools.count()
        self._zero_masks = {}  # shape -> device zeros: the bitmasks of steps with no constraint
        self.limits = Limits.of(self)
        self.faults = 0  # steps that raised (their requests failed, the engine went on)
        self.consecutive_faults = 0  # ... since the last step that did not
        self.spec_proposed = 0  # proposals verified, all requests since start
        self.spec_accepted = 0  # of those, accepted
        # the weights' version (update_weights); every RequestOutput carries the one it ran on
        self._weight_version: int | str = 0
        self._staged = None  # (params, version, requests to drain first): update under "drain"
        self._after_swap: list[Request] = []  # added while an update drains
        self._pending: list[RequestDelta] = []  # deltas of requests ended between steps
        self._sleep_level = 0  # 0 awake; 1 KV cache freed; 2 weights too (runtime/weights.py)
        self._host_params = None  # level 2: (host copies, shardings) of the weights

    def _init_images(self, vision):
        """The image side of a vision model (None without one)."""
        if vision is None:
            return None
        from jaxinfer.runtime.images import Images

        images = Images(vision, self.ecfg)
        n = images.spec.setting("tokens")  # a fixed count (Gemma 3), or None
        if n and self.shapes.budget < n:
            raise OptionError("prefill_chunk", f"({self.shapes.budget}) must hold an image's "
                                               f"{n} tokens: a step computes an image whole")
        windows = [w for i in range(self.cfg.num_layers) if (w := self.cfg.layer_window(i))]
        if n and windows and min(windows) < n:
            raise OptionError("model", f"a sliding window ({min(windows)}) narrower than an "
                                       f"image's {n} tokens is not supported")
        return images

    def image_door(self) -> ImageDoor | None:
        """What front ends need to take images for this model (None: text only)."""
        if self.images is None:
            return None
        return ImageDoor(self.images.spec, self.ecfg.max_image_pixels,
                         self.ecfg.limit_mm_per_prompt)

    def check_images(self, images, params: SamplingParams) -> None:
        """What a request's images [ImageInput] must meet beyond the image door: a vision model,
        their count, each run fitting a prefill step, no feature that cannot take them yet
        (several hosts, truncate_prompt_tokens).
        RequestError naming the field; front ends call it before queueing."""
        name = "multi_modal_data.image"
        if self.images is None:
            raise RequestError(name, "this model takes no images (it is text only)")
        if len(images) > self.ecfg.limit_mm_per_prompt:
            raise RequestError(name, f"{len(images)} images exceed limit_mm_per_prompt "
                                     f"({self.ecfg.limit_mm_per_prompt})")
        for why, bad in (("several hosts", self.plan_channel is not None),
                         ("truncate_prompt_tokens", params.truncate_prompt_tokens is not None)):
            if bad:
                raise RequestError(name, f"not supported with {why} yet")
        big = max(im.tokens for im in images)
        if big > self.shapes.budget:
            raise RequestError(name, f"an image of {big} tokens does not fit a prefill step "
                                     f"({self.shapes.budget} tokens: raise prefill_chunk)")

    def _image_door(self, prompt_ids, images, params: SamplingParams):
        """(prompt ids with each image's token run, its ImageSpans, multimodal RoPE positions
        and delta or (None, 0)) of a request with images [ImageInput] (RequestError naming the
        field otherwise)."""
        self.check_images(images, params)
        spec = self.images.spec
        ids, spans = expand(prompt_ids, images, spec)
        rope = mrope_positions(len(ids), spans, spec.mrope_merge) if spec.mrope_merge else (
            None, 0)
        return ids, spans, *rope

    def _arrays(self, plan, feed: bool = False, verify: bool = False) -> dict:
        """A plan's step (or verify step) arrays, with the encoder's embeddings on its image
        rows."""
        arrays = plan.verify_arrays() if verify else plan.device_arrays(feed=feed)
        if plan.mm_items:
            arrays.update(self.images.step_inputs(plan, self.cfg.hidden_size))
        return arrays

    @property
    def processed_logprobs(self) -> bool:
        return self.ecfg.logprobs_mode == "processed_logprobs"

    def _host_tier_store(self):
        """The host tier's page arrays, sized by kv_host_cache_gb (None when 0 or without
        prefix caching)."""
        ecfg = self.ecfg
        if not ecfg.kv_host_cache_gb or not ecfg.enable_prefix_caching:
            return None
        if ecfg.speculative is not None and ecfg.speculative.method == "draft":
            raise OptionError("kv_host_cache_gb", "not with a draft model yet (its own KV pages "
                                                  "would not follow the restored ones)")
        if jax.process_count() > 1:
            raise OptionError("kv_host_cache_gb", "not with several hosts yet")
        gib, page = ecfg.kv_host_cache_gb, self.cache.page_bytes
        slots = int(gib * 2 ** 30 // page)
        if slots < 1:
            raise OptionError("kv_host_cache_gb", f"{gib} GiB holds no KV page ({page} bytes)")
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if slots * page > ram // 2:
            raise OptionError("kv_host_cache_gb", f"{gib} GiB is more than half of this host's "
                                                  f"{ram / 2 ** 30:.1f} GiB of memory")
        return HostPages(self.cache, slots)

    def _move_kv(self, plan) -> None:
        """The host tier's copies before `plan`'s step: evicted pages to the host (the copy
        runs beside the step and lands in the host arrays at a later call, once done or once a
        restore needs it), then restored pages to the device (read from the host arrays first,
        so a slot reassigned to an offload in this plan still gives its old page)."""
        store = self.host_kv
        store.land(needed=[s for _, s in plan.kv_restores])
        t0 = time.perf_counter()
        blocks = store.read([s for _, s in plan.kv_restores]) if plan.kv_restores else None
        if plan.kv_offloads:
            store.send(gather_pages(self.cache, padded([p for p, _ in plan.kv_offloads])),
                       [s for _, s in plan.kv_offloads])
        if blocks is not None:
            pages = padded([p for p, _ in plan.kv_restores])
            self.cache = scatter_pages(self.cache, pages, store.pad(blocks, len(pages)))
            store.restore_s.append((time.perf_counter() - t0) / len(plan.kv_restores))

    def _new_procs(self):
        """Zeroed processor state rows, one per slot (replicated on a mesh)."""
        procs = init_state(self.ecfg.max_slots, self.proc_dims.shapes())
        if self.mesh is not None:
            from jaxinfer.runtime.device.sharding import replicated

            return jax.device_put(procs, replicated(self.mesh))
        return jax.device_put(procs, jax.devices()[0])  # committed, as a step's output

    @property
    def async_scheduling(self) -> bool:
        """Plan one step ahead: on unless configured off, speculating (proposals need every
        token known) or broadcasting plans to other hosts (they replay plans as sent)."""
        return (self.ecfg.async_scheduling and self.proposer is None
                and self.plan_channel is None)

    def _init_speculative(self, draft, kv_dtype, budget) -> None:
        from jaxinfer.runtime.device.steps import make_verify
        from jaxinfer.runtime.proposers import DraftModelProposer, NgramProposer, check_vocab

        if self.mesh is not None:
            raise ValueError("speculative decoding with tensor_parallel > 1 is not supported yet")
        sp, e = self.spec, self.ecfg
        if sp.method == "ngram":
            self.proposer = NgramProposer(sp.k, sp.n)
        else:
            if draft is None:
                raise ValueError("speculative method 'draft' needs the draft model (cfg, params)")
            dcfg, dparams = draft
            check_vocab(self.cfg, dcfg, repr(sp.model))
            extra = e.max_slots * (-(-sp.k // e.page_size) + 1)  # proposals past max_model_len
            self.proposer = DraftModelProposer(
                dcfg, dparams, k=sp.k, max_slots=e.max_slots, page_size=e.page_size,
                num_pages=e.total_pages + extra, token_budget=budget, backend=self.backend,
                # a shadow holds up to k proposals past max_model_len
                page_buckets=page_buckets(e, -(-(e.max_model_len + sp.k) // e.page_size),
                                         self.backend),
                dtype=kv_dtype)
        self._verify = make_verify(self.cfg, self.backend, vocab_limit=self.text_vocab,
                                   processed_logprobs=self.processed_logprobs)

    # ---- LoRA adapters -----------------------------------------------------------------------
    def add_lora(self, name: str, path: str):
        """Register the PEFT adapter at `path` as `name` (read and checked now); -> Adapter."""
        if self.adapters is None:
            raise ValueError("this engine serves no LoRA adapters (enable_lora=False)")
        return self.adapters.add(name, path)

    def remove_lora(self, name: str) -> None:
        """Unload `name`; refused (ValueError) while an unfinished request uses it."""
        a = self._idle_adapter(name)
        self.scheduler.evict_lora(a.key)
        self.adapters.remove(name)
        self._drop_lora_dir(a.path)

    def _idle_adapter(self, name: str):
        """The adapter registered as `name`; UnknownAdapter, or AdapterInUse while an unfinished
        request uses it."""
        a = self.adapters.get(name) if self.adapters is not None else None
        if a is None:
            raise UnknownAdapter(f"unknown LoRA adapter {name!r}")
        users = self.outputs.users_of(name)
        if users:
            raise AdapterInUse(f"LoRA adapter {name!r} is in use by {users} unfinished "
                               "request(s)")
        return a

    def _drop_lora_dir(self, path: str) -> None:
        """Delete a temporary dir update_lora wrote for in-memory tensors, once unused."""
        if path in self._lora_dirs:
            import shutil

            self._lora_dirs.discard(path)
            shutil.rmtree(path, ignore_errors=True)

    def update_lora(self, name: str, weights):
        """Serve adapter `name` from new weights: a PEFT dir, or a dict of its tensors by their
        PEFT names (a trainer's: written beside a copy of the current adapter's
        adapter_config.json, so its rank and alpha hold). Read and checked first: a bad one
        leaves the old weights serving. A fresh key: the old weights' device slot and
        prefix-cache pages are never reused for it. Refused (AdapterInUse) while an unfinished
        request uses it. -> the new Adapter."""
        a = self._idle_adapter(name)
        if isinstance(weights, dict):
            from jaxinfer.checkpoints.peft import write_peft_tensors

            weights = write_peft_tensors(weights, like=a.path)
            self._lora_dirs.add(weights)
        try:
            old, new = self.adapters.replace(name, weights)
        except Exception:
            self._drop_lora_dir(weights)
            raise
        self._drop_lora_dir(old.path)
        self.scheduler.evict_lora(old.key)
        return new

    def check_lora(self, name: str | None) -> None:
        self._lora_key(name)

    def lora_adapters(self) -> dict[str, str] | None:
        if self.adapters is None:
            return None
        return {n: self.adapters.get(n).path for n in self.adapters.names()}

    def _lora_key(self, name: str | None) -> str | None:
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

    # ---- weights: in-place updates, sleep / wake (runtime/weights.py) -----------------------
    def get_weights(self):
        """The weights in the model's own layout (runtime/weights.py): a Params tree of device
        arrays, fresh arrays where the engine's form differs (fused, output-major)."""
        self._awake_weights("get_weights")
        return loaded_form(self.params)

    def update_weights(self, weights, *, version: int | str | None = None,
                       policy: str = "drain") -> int | str:
        """Serve `weights` (a Params tree in get_weights()'s layout, or a checkpoint of this
        model) from the next step on, with the step programs already compiled. Checked and
        built whole first: any failure raises (WeightError naming the tensor) and the current
        version keeps serving, bit for bit. Unfinished requests: "drain" (default) finishes them
        on the current weights while requests added meanwhile wait for the new ones; "abort"
        ends them now (finish reason "abort", their deltas come with the next step). The
        prefix cache is dropped at the swap. Returns the new version (default: the last + 1)."""
        if policy not in UPDATE_POLICIES:
            raise ValueError(f"policy must be one of {UPDATE_POLICIES}, got {policy!r}")
        if version is not None and (isinstance(version, bool)
                                    or not isinstance(version, (int, str))):
            raise ValueError(f"version must be an int or a str, got {type(version).__name__}")
        new = rebuild(weights, self, *(self._host_params or (self.params, None)))
        # (asleep at level 2: checked against the host copies and their shardings; the new
        # weights go on the device and the engine sleeps on at level 1)
        if version is None:
            last = self._staged[1] if self._staged is not None else self.weight_version
            version = last + 1 if isinstance(last, int) else 1
        if self._staged is not None:  # a newer version replaces the one still draining
            self._staged = (new, version, self._staged[2])
        elif policy == "abort" or not self.outputs.ids():
            for rid in self.outputs.ids():
                self._pending.append(self._abort_delta(rid))
            self._staged = (new, version, ())
            self._swap_when_drained()
        else:
            self._staged = (new, version, tuple(self.outputs.ids()))
        return version

    @property
    def weight_version(self) -> int | str:
        """The version serving now (0: the weights loaded at start)."""
        return self._weight_version

    @property
    def sleep_level(self) -> int:
        """0 awake; 1 the KV cache freed; 2 the weights too."""
        return self._sleep_level

    @property
    def weights_pending(self) -> bool:
        """An update waits for unfinished requests to drain."""
        return self._staged is not None

    def _swap_when_drained(self) -> None:
        params, version, draining = self._staged
        if any(rid in self.outputs for rid in draining):
            return
        old, self.params = self.params, params
        if self.proposer is not None and getattr(self.proposer, "params", None) is old:
            self.proposer.params = params  # the target drafts itself
        self._weight_version, self._staged = version, None
        if self._host_params is not None:  # updated while asleep: the weights are awake now
            self._host_params, self._sleep_level = None, 1
        self.scheduler.reset_prefix_cache()
        log.info("serving weight version %s", version)
        waiting, self._after_swap = self._after_swap, []
        for req in waiting:
            self._admit(req)

    def _abort_delta(self, rid: str) -> RequestDelta:
        """End unfinished request `rid` now (finish reason "abort"): its last delta."""
        staged = [r for r in self._after_swap if r.request_id == rid]
        if staged:  # waiting for an update's new weights
            self._after_swap.remove(staged[0])
        elif self.constraints is None or rid not in self.constraints.held:
            self.scheduler.abort(rid)
        self._release(rid)
        return self.outputs.finish(rid, "abort", time.monotonic())

    def sleep(self, level: int = 1) -> dict:
        """Give the device memory back to a colocated trainer: level 1 frees the KV cache (and
        drops the prefix cache), level 2 also the weights (copied to the host for wake_up, or
        replaced by an update_weights while asleep; arrays a caller still holds, e.g. the
        trainer's own passed to update_weights, stay theirs). Requests are refused while asleep
        (EngineAsleep, a QueueFull: retry later); refused with unfinished requests. Returns
        {"device_bytes_before", "device_bytes_after"} (runtime/weights.device_bytes)."""
        if isinstance(level, bool) or level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        if self.outputs.ids() or self._staged is not None:
            raise RuntimeError(f"cannot sleep with {len(self.outputs.ids())} unfinished "
                               "requests: let them finish or abort them first")
        if self.proposer is not None and getattr(self.proposer, "cache", None) is not None:
            raise RuntimeError("sleep with a draft model is not supported yet")
        while self._inflight is not None or self._held is not None:
            self.step()  # a step planned past every request's end: its results are nobody's
        before = device_bytes()
        if self.sleep_level == 0:
            delete((self.cache, self.procs))
            self.cache = self.procs = None
            self.scheduler.reset_prefix_cache()
        if level == 2 and self.sleep_level < 2:  # the engine's references go; a caller's stay
            self._host_params, self.params = to_host(self.params), None
        self._sleep_level = max(self._sleep_level, level)
        return {"device_bytes_before": before, "device_bytes_after": device_bytes()}

    def wake_up(self) -> dict:
        """Take the device memory back (weights first, then a fresh KV cache); outputs equal
        those before sleep. Returns {"device_bytes_before", "device_bytes_after"}."""
        before = device_bytes()
        if self._host_params is not None:
            self.params = from_host(*self._host_params)
            self._host_params = None
        if self.cache is None:
            self.cache, self.procs = self._new_cache(), self._new_procs()
        self._sleep_level = 0
        return {"device_bytes_before": before, "device_bytes_after": device_bytes()}

    def _awake_weights(self, what: str) -> None:
        if self._host_params is not None:
            raise EngineAsleep(f"{what}: the weights are asleep (level 2): wake_up() first")

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, prompt_ids, params: SamplingParams, request_id: str | None = None, *,
                    lora: str | None = None, refuse_late: bool = True,
                    prompt: str | None = None, images=()) -> str:
        """Queue a request (checked by the request door again: nothing unchecked reaches a
        step), with the LoRA adapter named `lora` (None: the base model); `prompt`: its text,
        echoed in the output. Raises RequestError naming the field; Overloaded when the engine
        refuses late requests (refuse_late=False: the caller checked already). `images`
        [ImageInput] (runtime/host/image_prompt.py): one per image mark in the prompt."""
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.outputs:
            raise ValueError(f"duplicate request_id {rid!r}")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        prompt_ids = [int(t) for t in prompt_ids]
        spans, rope, delta = (), None, 0
        if images:
            prompt_ids, spans, rope, delta = self._image_door(prompt_ids, list(images), params)
        prompt_ids = truncate_prompt(prompt_ids, params)
        check_request(prompt_ids, params, self.limits)
        key = self._lora_key(lora)
        procs = ProcessorSpec.of(params, self.eos_ids, self.tokenizer)
        if procs is not None and self.plan_channel is not None:
            raise RequestError(processor_fields(params)[0], "not supported with several hosts "
                                                            "yet (the state rows are not sent)")
        if self.sleep_level:
            raise EngineAsleep(f"the engine is asleep (level {self.sleep_level}): wake_up() "
                               "before adding requests")
        if refuse_late:
            self.scheduler.check_overload(rid, len(prompt_ids), params.priority)
        now = time.monotonic()
        req = Request(request_id=rid, prompt_ids=prompt_ids, params=params, eos_ids=self.eos_ids,
                      arrival_time=now, lora=key, procs=procs, images=spans,
                      rope_positions=rope, rope_delta=delta)
        if self._staged is not None:  # an update drains: this one runs on the new weights
            self._after_swap.append(req)
        else:
            self._admit(req)
        version = self.weight_version if self._staged is None else self._staged[1]
        self.outputs.add(rid, prompt_ids, params, now=now, lora=lora, prompt=prompt,
                         weight_version=version)
        return rid

    def _admit(self, req: Request) -> None:
        if req.params.structured_outputs is not None:  # scheduled once its matcher is built
            self.constraints.hold(req, req.params.structured_outputs)
        else:
            self.scheduler.add_request(req)

    def abort(self, request_id: str) -> RequestOutput | None:
        if request_id not in self.outputs:
            return None
        return self._abort_delta(request_id).output

    @property
    def has_work(self) -> bool:
        """Something for step() to do: scheduled work, or requests whose grammar is compiling."""
        return (self.scheduler.has_work or bool(self.constraints and self.constraints.held)
                or bool(self._pending) or self._staged is not None)

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: the scheduler's queue and those whose grammar compiles."""
        held = len(self.constraints.held) if self.constraints else 0
        return self.scheduler.num_waiting + held + len(self._after_swap)

    @property
    def num_unfinished(self) -> int:
        return len(self.outputs)

    def check_admission(self, prompt_len: int, priority: int = 0) -> None:
        self.scheduler.check_overload("", prompt_len, priority)

    def stats(self) -> dict:
        sch, slo = self.scheduler, self.scheduler.latency_targets
        return {"running": sch.num_running, "waiting": self.num_waiting,
                "max_slots": sch.max_slots, "pages_total": sch.allocator.num_total,
                "pages_free": sch.free_pages, "compile_count": self.compile_count,
                "faults": self.faults, "consecutive_faults": self.consecutive_faults,
                "spec_proposed": self.spec_proposed, "spec_accepted": self.spec_accepted,
                "processor_state_bytes": sum(x.nbytes for x in jax.tree.leaves(self.procs)),
                **(self.host_kv.stats(sch.host_tier) if self.host_kv is not None else {}),
                **(self.images.stats() if self.images is not None else {}),
                "ttft_target_s": slo.ttft_s, "itl_target_s": slo.itl_s}

    @property
    def compile_count(self) -> int:
        """Distinct programs this engine has launched (steps.Launches): the step, and under
        speculation the verify step and the draft model's step. Engines of one model in one
        process share their compiled programs, so a program may have been compiled by another."""
        n = self._step.count + (self._verify.count if self._verify is not None else 0)
        return n + (self.proposer.compile_count if self.proposer is not None else 0)

    def warmup(self, logprobs: bool = False, filtered: bool = False, wait: bool = True) -> int:
        """Compile every step shape the scheduler can emit (token x page x q_len buckets; q_len
        1 only for steps small enough to be decode-only) with all-padding plans; under
        speculation also the verify step (no proposer distributions: greedy, n-gram) and the
        draft model's steps. Returns the number of new compilations. `wait=False` with
        compile_mode "background" (one device): queue the programs on the background compiler
        and return at once (0); steps run layer by layer until theirs are ready."""
        if not wait and self.background_compiles:
            prev, procs = self._prev(), self.procs
            self._step.warmup([(self.params, self.cache, self._device_masks(plan), prev, q, procs)
                               for plan, q in self._warmup_plans()])
            return 0
        before = self.compile_count
        s, w = self.ecfg.max_slots, self.scheduler.mask_words
        n_lp = LOGPROBS_BUCKET if logprobs else 0
        with self._step.waiting() if isinstance(self._step, StepPrograms) else nullcontext():
            self._warmup_steps(logprobs, filtered, s, w, n_lp)
        if self.proposer is not None:
            self.proposer.warmup()
        return self.compile_count - before

    def settle(self, timeout: float | None = None) -> bool:
        """Wait for the programs this engine queued on the background compiler (first uses of
        a shape, warm-up without waiting); -> whether all are done within `timeout` s."""
        return self._step.settle(timeout) if isinstance(self._step, StepPrograms) else True

    def _warmup_steps(self, logprobs, filtered, s, w, n_lp) -> None:
        for plan, q in self._warmup_plans():
            self._run(plan, q, logprobs, filtered, prev=self._prev())
            if self._verify is not None and q > 1:  # a verify row has 1 + d > 1 tokens
                t, p = plan["token_ids"].shape[0], plan["page_indices"].shape[1]
                arrays = verify_inputs(padding_arrays(
                    STEP_GROUPS + ("speculative",), T=t, S=s, P=p, K=self.spec.k, W=w))
                self._run_verify(arrays, None, np.zeros(s, np.int32), q, n_lp, filtered)

    @property
    def background_compiles(self) -> bool:
        """Steps run layer by layer while their programs compile in the background (compile
        mode "background", one device)."""
        return isinstance(self._step, StepPrograms) and self._step.mode == "background"

    def _warmup_plans(self):
        """(all-padding plan arrays, q_len) of every step shape, smallest first."""
        sh, s = self.shapes, self.ecfg.max_slots
        decode_t = min(b for b in sh.tokens if b >= s)
        groups = STEP_GROUPS + ("feed",) if self.async_scheduling else STEP_GROUPS
        for t in sh.tokens:
            qs = {min(b, t) for b in sh.q_lens if b > 1} | ({1} if t <= decode_t else set())
            for p in sh.pages:
                for q in sorted(qs):
                    yield padding_arrays(groups, T=t, S=s, P=p, W=self.scheduler.mask_words), q

    # ---- several hosts -----------------------------------------------------------------------
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
            self._run(arrays, max_q_len, num_logprobs > 0, filtered)
            n += 1

    # ---- launching a step --------------------------------------------------------------------
    def _prev(self):
        """`prev` for the next launch: the in-flight step's sampled tokens (None when not
        scheduling asynchronously)."""
        if not self.async_scheduling:
            return None
        if self._inflight is not None:
            return self._inflight[2]
        if self._no_prev is None:
            self._no_prev = jax.device_put(np.zeros(self.ecfg.max_slots, np.int32),
                                           jax.devices()[0])  # committed, as a step's tokens
            if self.mesh is not None:
                from jaxinfer.runtime.device.sharding import replicated

                self._no_prev = jax.device_put(self._no_prev, replicated(self.mesh))
        return self._no_prev

    def _run(self, arrays, max_q_len, logprobs, filtered, prev=None):
        """Launch the step on a plan's arrays (the cache and processor state move on); -> its
        packed output. Rows scoring prompt tokens (prompt_targets >= 0) select the step's
        prompt-logprob program, whose output is (packed, prompt rows)."""
        prompt = bool((np.asarray(arrays["prompt_targets"]) >= 0).any())
        if self.plan_channel is not None and self.leader:  # followers run the same step
            self.plan_channel.send(arrays, max_q_len, LOGPROBS_BUCKET if logprobs else 0, filtered)
        if self.mesh is not None and jax.process_count() > 1:
            from jaxinfer.runtime.device.distributed import global_plan

            arrays = global_plan(arrays, self.mesh)
        elif self.mesh is None:
            arrays = self._device_masks(arrays)
        packed, self.cache, self.procs = self._step(
            self.params, self.cache, arrays, max_q_len=max_q_len,
            num_logprobs=LOGPROBS_BUCKET if logprobs else 0, filtered=filtered,
            prompt_logprobs=prompt, prev=prev, procs=self.procs)
        return packed

    def _run_verify(self, arrays, q_probs, q_rows, max_q_len, num_logprobs, filtered):
        """Launch the verify step (the cache and processor state move on); -> its packed output."""
        packed, self.cache, self.procs = self._verify(
            self.params, self.cache, self._device_masks(arrays), q_probs, q_rows,
            max_q_len=max_q_len, num_logprobs=num_logprobs, filtered=filtered, procs=self.procs)
        return packed

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

    # ---- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """One engine step. A step that raises fails the requests it may have touched (finish
        reason "error", slots and pages freed) and the engine goes on with the rest."""
        t0 = time.perf_counter()
        if self._period is not None:  # the last call's plan, timed start to start
            start, plan = self._period
            self.scheduler.record_step_time(plan, t0 - start)
        self._period = None
        self._timed = None  # the plan this call waits for (async: the one launched before)
        deltas, self._pending = self._pending, []
        try:
            if self._staged is not None:
                self._swap_when_drained()
            programs = self.compile_count
            if self.constraints and self.constraints.held:
                deltas += self._admit_constrained()
            deltas += self._step_async() if self.async_scheduling else self._step_sync()
            self.consecutive_faults = 0
            if self._timed is not None and self.compile_count == programs:  # (no compile)
                if self.scheduler.has_work:  # the caller comes straight back: time its period
                    self._period = (t0, self._timed)
                else:
                    self.scheduler.record_step_time(self._timed, time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 - a request may fail; the engine may not
            deltas += self._recover(exc)
        st = self.step_stats
        st["steps"] += 1
        st["step_s"] += time.perf_counter() - t0
        return deltas

    def _recover(self, exc: Exception) -> list[RequestDelta]:
        """After a failed step: every request that held a slot (all rows of the failed and the
        in-flight plan) fails with finish reason "error"; waiting requests stay queued. A cache
        the failed step consumed (donated) is rebuilt empty, with the prefix cache dropped."""
        log.error("engine step failed; failing the running requests", exc_info=exc)
        self.faults += 1
        self.consecutive_faults += 1
        self._inflight = self._held = None
        failed = self.scheduler.fail_running()
        if self.constraints is not None:  # held requests may be what failed: fail them too
            failed += list(self.constraints.held)
        if any(x.is_deleted() for x in jax.tree.leaves(self.cache)):
            self.cache = self._new_cache()
            self.scheduler.reset_prefix_cache()
        if any(x.is_deleted() for x in jax.tree.leaves(self.procs)):
            self.procs = self._new_procs()  # the running requests failed: no row is in use
        now, why = time.monotonic(), f"engine step failed: {type(exc).__name__}: {exc}"
        return [d for rid in failed if (d := self._end(rid, "error", now, why)) is not None]

    def _end(self, rid: str, reason: str, now: float, error: str | None = None):
        """End a request outside the step's tokens: its last delta (None if not unfinished)."""
        self._release(rid)
        return self.outputs.finish(rid, reason, now, error)

    def _release(self, rid: str) -> None:
        """Drop what the proposer and the grammars keep for a request that ended."""
        if self.proposer is not None:
            self.proposer.release(rid)
        if self.constraints is not None:
            self.constraints.drop(rid)

    def _admit_constrained(self) -> list[RequestDelta]:
        """Schedule held requests whose matcher is built (when nothing else can run, wait a
        little for one); a matcher that failed fails its request."""
        idle = not self.scheduler.has_work and self._inflight is None
        deltas, now = [], time.monotonic()
        for req, why in self.constraints.ready(wait_s=0.05 if idle else 0.0):
            if req.request_id not in self.outputs:
                self.constraints.drop(req.request_id)
            elif why is None:
                self.scheduler.add_request(req)
            else:
                deltas.append(self._end(req.request_id, "error", now, why))
        return deltas

    def _schedule(self):
        """The next plan, with its constrained rows' token masks filled."""
        plan = self.scheduler.schedule()
        if plan is not None and (plan.kv_offloads or plan.kv_restores):
            self._move_kv(plan)
        if plan is not None and plan.lora_loads:
            self._load_lora_slots(plan.lora_loads)
        for slot, seq in plan.proc_loads if plan is not None else ():
            row = seq.req.procs.slot_row(self.proc_dims, seq.req.prompt_ids, seq.output_ids)
            self.procs = write_slot(self.procs, np.int32(slot), row)
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

    def _step_sync(self) -> list[RequestDelta]:
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
        packed = self._run(self._arrays(plan), plan.max_q_len, plan.num_logprobs > 0, filtered)
        host, prompt = self._fetch(packed)  # [S, 1 (+ 1 + 2n)], [T, 1 + 2n] or None
        now = self._mark_scheduled(plan)
        return self._apply(plan, host, self.scheduler.update(plan, host[:, 0].astype(np.int32)),
                           now, prompt)

    def _step_async(self) -> list[RequestDelta]:
        """Launch the next step (fed from the one in flight), then apply the one in flight. A
        step in flight with constrained rows is applied first: their next masks need its tokens."""
        if self._inflight is not None and self.constraints and self.constraints.any_in(self._inflight[0]):
            done, self._inflight = self._inflight, None
            return self._apply_launched(done)
        if self._held is not None:  # planned last call, held back from a compile
            plan, arrays, prev = self._held
            self._held = None
        else:
            plan = self._schedule()
            arrays = self._arrays(plan, feed=True) if plan is not None else None
            prev = self._prev()
        launched = None
        if plan is not None:
            if self._inflight is not None and self._would_compile(plan, arrays, prev):
                # hand out the tokens in flight before a compile, not after it (a first token
                # does not wait for the decode step's programs); launch this plan next call
                self._held = (plan, arrays, prev)
                done, self._inflight = self._inflight, None
                return self._apply_launched(done)
            packed = self._run(arrays, plan.max_q_len, plan.num_logprobs > 0, _filtered(plan),
                               prev=prev)
            for x in jax.tree.leaves(packed):
                x.copy_to_host_async()
            launched = (plan, packed, sampled_tokens(packed))
            self._mark_scheduled(plan)
        done, self._inflight = self._inflight, launched
        return [] if done is None else self._apply_launched(done)

    def _would_compile(self, plan, arrays, prev) -> bool:
        step = self._step
        if not isinstance(step, StepPrograms):
            return False
        return step.compiles(self.params, self.cache, self._device_masks(arrays),
                             max_q_len=plan.max_q_len,
                             num_logprobs=LOGPROBS_BUCKET if plan.num_logprobs > 0 else 0,
                             filtered=_filtered(plan), prompt_logprobs=bool(
                                 (np.asarray(arrays["prompt_targets"]) >= 0).any()),
                             prev=prev, procs=self.procs)

    def _apply_launched(self, done) -> list[RequestDelta]:
        plan, packed, _ = done
        host, prompt = self._fetch(packed)  # [S, 1 (+ 1 + 2n)], [T, 1 + 2n] or None
        now = time.monotonic()
        return self._apply(plan, host, self.scheduler.update(plan, host[:, 0].astype(np.int32)),
                           now, prompt)

    def _verify_step(self, plan, props, filtered) -> list[RequestDelta]:
        """Target forward over every row's last token + proposals, acceptance on the device."""
        K = plan.spec_k
        assert not plan.prompt_logprobs, "the scheduler plans no proposals beside prompt scoring"
        q_rows = np.zeros(len(plan.kv_lens), np.int32)
        q_probs = None
        if props is not None and props.q_probs is not None:
            q_probs = props.q_probs
            for s, rid in enumerate(plan.request_ids):
                q_rows[s] = props.q_rows.get(rid, 0)
        packed = self._run_verify(self._arrays(plan, verify=True), q_probs, q_rows,
                                  plan.max_q_len, plan.num_logprobs, filtered)
        host, _ = self._fetch(packed)  # [S, 2 + K (+ 1 + 2n)]
        now = self._mark_scheduled(plan)
        outs = self.scheduler.update(plan, host[:, 1:K + 2].astype(np.int32),
                                     host[:, 0].astype(np.int32))
        # logprob columns laid out as the plain step's: [token, chosen, top vals, top ids]
        return self._apply(plan, host[:, K + 1:], outs, now)

    def _mark_scheduled(self, plan) -> float:
        """Stamp first-scheduled time and prefix-cache hits (before update() retires anyone)."""
        now = time.monotonic()
        self.outputs.scheduled(plan.request_ids, now, self.scheduler.cached_tokens_of)
        return now

    def _apply(self, plan, host, outputs, now, prompt=None) -> list[RequestDelta]:
        """The scheduler's outputs of a step -> deltas. A request a grammar ends, or whose text
        completes a stop string, is retired from the scheduler here."""
        self._timed = plan
        if prompt is not None:  # before the tokens: a first token streams with its prompt's
            self.outputs.record_prompt_logprobs(plan, prompt)
        row_of = {rid: s for s, rid in enumerate(plan.request_ids)}
        deltas = []
        for out in outputs:
            rid = out.request_id
            if rid not in self.outputs:
                continue
            if out.num_proposed:
                self.outputs.speculation(rid, out.num_proposed, out.num_accepted)
                self.spec_proposed += out.num_proposed
                self.spec_accepted += out.num_accepted
            finished, reason, error = out.finished, out.finish_reason, None
            if self.constraints is not None and rid in self.constraints.live:
                ended, why = self.constraints.advance(rid, out.new_token_ids)
                if ended is not None and not finished:
                    self.scheduler.finish(rid, ended)
                    finished, reason, error = True, ended, why or None
            d = self.outputs.tokens(rid, out.new_token_ids, finished, reason,
                                    host[row_of[rid]], plan.num_logprobs, now, error)
            if d.finished:
                if not finished:  # its text completed a stop string
                    self.scheduler.finish(rid, d.finish_reason)
                self._release(rid)
            deltas.append(d)
        return deltas

    # ---- embeddings
    def embed(self, prompts, pooling: str | None = None, normalize: bool = True) -> np.ndarray:
        """Token-id prompts -> f32 [n, D] pooled final hidden states (runtime/embedding.py);
        the engine's cache and scheduler are untouched. RequestError naming the field."""
        from jaxinfer.runtime.embedding import embedder

        return embedder(self)(prompts, pooling, normalize)


def _filtered(plan) -> bool:
    """Whether any live row samples with top-k / top-p / min-p (a static flag of the step)."""
    live = slice(0, int(plan.num_seqs[0]))
    return bool(np.any(
        (plan.temperature[live] > 0)
        & ((plan.top_k[live] > 0) | (plan.top_p[live] < 1) | (plan.min_p[live] > 0))
    ))
