"""The engine as its callers see it: the members the front ends use (the serving loop behind gRPC
and HTTP, the JSONL runner, Ray replicas, `LLM`), declared once. `runtime.engine.Engine`
implements it, and so do the test fakes; a front end that needs something else adds it here
first. No JAX: the front ends and the host room import it.

`missing_members(obj)` lists what an object (or class) lacks of the interface, with signatures
checked: the test that keeps the engine and every fake honest.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from jaxinfer.runtime.host.outputs import RequestDelta, RequestOutput
from jaxinfer.runtime.host.requests import Limits, SamplingParams


@runtime_checkable
class EngineInterface(Protocol):
    """Single-threaded: one thread calls every member but the read-only `stats`."""

    limits: Limits  # what a request may ask of the served model (the request door's bounds)
    leader: bool  # False on a follower process of a multi-host job (it only runs `follow`)

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams,
                    request_id: str | None = None, *, lora: str | None = None,
                    refuse_late: bool = True, prompt: str | None = None, images=()) -> str:
        """Queue a request (checked at the request door again); its id. Raises RequestError
        naming the field, Overloaded when `refuse_late` and it is predicted to miss its TTFT
        target. `images` [(digest, pixels)]: one per image mark (runtime/host/image_prompt.py)."""

    def abort(self, request_id: str) -> RequestOutput | None:
        """End an unfinished request now (slot and pages freed): its output, finish reason
        "abort"; None when it is not unfinished."""

    def step(self) -> list[RequestDelta]:
        """Run one step; a delta per request that advanced or ended. Never raises for a
        request's sake: a failed step ends the requests it held with finish reason "error"."""

    @property
    def has_work(self) -> bool:
        """Something for step() to do."""

    @property
    def num_waiting(self) -> int:
        """Requests admitted but not yet running."""

    @property
    def num_unfinished(self) -> int:
        """Requests added and not yet finished (waiting or running)."""

    def image_door(self):
        """runtime.host.image_prompt.ImageDoor of a vision model (the image spec, the pixel cap,
        images a prompt may carry); None for a text-only one."""

    def check_images(self, images: Sequence, params: SamplingParams) -> None:
        """RequestError naming the field when a request's images (runtime/host/image_prompt.py
        ImageInput) cannot be served: a text-only model, too many, too large for a prefill
        step, or with a feature that cannot take them yet. Called only for requests with
        images."""

    def check_admission(self, prompt_len: int, priority: int = 0) -> None:
        """Raise Overloaded when a request of `prompt_len` tokens arriving now is predicted to
        miss the TTFT target (only with refuse_late); safe from another thread."""

    def stats(self) -> dict:
        """Counters and gauges (any thread): running, waiting, max_slots, pages_total,
        pages_free, compile_count, faults, consecutive_faults, spec_proposed, spec_accepted,
        ttft_target_s, itl_target_s."""

    def add_lora(self, name: str, path: str):
        """Register the PEFT adapter at `path` as `name` (read and checked now, any thread);
        ValueError names the problem."""

    def remove_lora(self, name: str) -> None:
        """Unload `name`; ValueError while an unfinished request uses it."""

    def check_lora(self, name: str | None) -> None:
        """RequestError (field "lora") unless `name` is None or a loaded adapter."""

    def lora_adapters(self) -> dict[str, str] | None:
        """{name: path} of the loaded adapters; None when the engine serves none."""

    def embed(self, prompts: Sequence[Sequence[int]], pooling: str | None = None,
              normalize: bool = True):
        """Token-id prompts -> their embeddings, an f32 array [n, D] (pooling "last", "mean"
        or "cls"; None: the model's default), through the model's prefill with no KV pages
        kept. RequestError naming the field."""

    def update_weights(self, weights, *, version: int | str | None = None,
                       policy: str = "drain") -> int | str:
        """Serve new weights (a Params tree or a checkpoint path) with the compiled programs;
        atomic (WeightError names the tensor; the old version serves on). "drain": unfinished
        requests finish on the old weights first (weights_pending until then); "abort": they
        end now. Returns the new version."""

    @property
    def weights_pending(self) -> bool:
        """An update waits for unfinished requests to drain."""

    @property
    def weight_version(self) -> int | str:
        """The version serving now; every RequestOutput carries the one it ran on."""

    def sleep(self, level: int = 1) -> dict:
        """Free the KV cache (1) and the weights too (2); requests are refused (EngineAsleep)
        until wake_up. {"device_bytes_before", "device_bytes_after"}."""

    def wake_up(self) -> dict:
        """Take the device memory back; {"device_bytes_before", "device_bytes_after"}."""

    @property
    def sleep_level(self) -> int:
        """0 awake, else the level slept at."""

    def warmup(self) -> int:
        """Compile every step shape up front; the number of new programs."""

    def follow(self) -> int:
        """On a follower process: run the leader's steps until it releases; the steps run."""

    def release_followers(self) -> None:
        """On the leader: let the followers' `follow` return."""


def members() -> list[str]:
    return sorted(n for n in dir(EngineInterface) if not n.startswith("_")
                  and n not in ("limits", "leader")) + ["leader", "limits"]


def missing_members(obj) -> list[str]:
    """What `obj` (an engine, or an engine class: then without its data members) lacks of
    EngineInterface: absent members, and methods whose parameters differ in name or kind
    (extra parameters with defaults are fine)."""
    out = []
    cls = obj if isinstance(obj, type) else type(obj)
    for name in members():
        want = inspect.getattr_static(EngineInterface, name, None)
        if name in ("limits", "leader"):  # data: checked on an instance only
            if not isinstance(obj, type) and not hasattr(obj, name):
                out.append(name)
            continue
        got = inspect.getattr_static(cls, name, None)
        if got is None:
            out.append(name)
        elif isinstance(want, property) != isinstance(got, property):
            out.append(f"{name} (property)" if isinstance(want, property) else f"{name} (method)")
        elif callable(want) and not _compatible(want, got):
            out.append(f"{name}{inspect.signature(got)} != {name}{inspect.signature(want)}")
    return out


def _compatible(want, got) -> bool:
    w = list(inspect.signature(want).parameters.values())
    g = list(inspect.signature(got).parameters.values())
    if [(p.name, p.kind) for p in w] != [(p.name, p.kind) for p in g[:len(w)]]:
        return False
    return all(p.default is not p.empty for p in g[len(w):])  # extras must be optional
