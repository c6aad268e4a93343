"""Several hosts, one engine: joining the job, and the plans the leader broadcasts each step.

Process 0 (the leader) schedules; before it launches a step it broadcasts the step's plan
(`PlanChannel.send`: one fixed-size int32 buffer packed by `PlanCodec`, over
`multihost_utils.broadcast_one_to_all`), and every follower runs the same jitted step on its
devices (`Engine.follow`: SPMD needs every process to dispatch the same program). Plans become
replicated global arrays (`global_plan`) when the mesh spans processes. See README "Multi-host
serving".
"""

from __future__ import annotations

import os
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh

from jaxinfer.runtime.device.sharding import put, replicated
from jaxinfer.runtime.plan import STEP_GROUPS, fields_of, plan_dims


def global_plan(arrays: dict, mesh: Mesh) -> dict:
    """Plan arrays as replicated global arrays (needed when the mesh spans processes; every
    process holds the same host values)."""
    rep = replicated(mesh)
    return {k: put(v, rep) for k, v in arrays.items()}


def init_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None) -> bool:
    """Join a multi-process JAX job. Arguments default to the env vars
    JAXINFER_COORDINATOR_ADDRESS / JAXINFER_NUM_PROCESSES / JAXINFER_PROCESS_ID; with none set,
    `jax.distributed.initialize()` auto-detects the cluster (Cloud TPU pod slices, SLURM,
    Open MPI). Idempotent. Returns True when this process is the leader (process 0)."""
    env = os.environ
    coordinator_address = coordinator_address or env.get("JAXINFER_COORDINATOR_ADDRESS")
    if num_processes is None and env.get("JAXINFER_NUM_PROCESSES"):
        num_processes = int(env["JAXINFER_NUM_PROCESSES"])
    if process_id is None and env.get("JAXINFER_PROCESS_ID"):
        process_id = int(env["JAXINFER_PROCESS_ID"])
    if not jax.distributed.is_initialized():
        jax.distributed.initialize(coordinator_address=coordinator_address,
                                   num_processes=num_processes, process_id=process_id)
    return is_leader()


def is_leader() -> bool:
    return jax.process_index() == 0


_FIELDS = fields_of(*STEP_GROUPS)  # 4-byte dtypes: bit-cast to int32 and back
_DIMS = ("T", "S", "P", "W")
_MAGIC = 0x4A58504C  # "JXPL"
_HEADER = 9  # magic, stop, T, S, P, W, max_q_len, num_logprobs, filtered


class PlanCodec:
    """Packs one step (plan arrays + static args) into a fixed-size int32 buffer, so every
    process can take part in one fixed-shape broadcast per step. 4-byte fields (f32, u32) are
    bit-cast, so the round trip is exact."""

    def __init__(self, max_tokens: int, max_seqs: int, max_pages: int, mask_words: int = 1):
        self.capacity = dict(zip(_DIMS, (max_tokens, max_seqs, max_pages, mask_words)))
        self.size = _HEADER + sum(int(np.prod(f.extent(self.capacity))) for f in _FIELDS)

    def pack(self, arrays: dict, max_q_len: int, num_logprobs: int, filtered: bool) -> np.ndarray:
        dims = plan_dims(arrays, _FIELDS)
        if any(dims[d] > self.capacity[d] for d in _DIMS):
            raise ValueError(f"plan {dims} exceeds the codec's capacity {self.capacity}")
        buf = np.zeros(self.size, np.int32)
        buf[:_HEADER] = (_MAGIC, 0, *(dims[d] for d in _DIMS), max_q_len, num_logprobs,
                         int(filtered))
        off = _HEADER
        for f in _FIELDS:
            a = np.asarray(arrays[f.name])
            shape = f.extent(dims)
            if a.shape != shape or a.dtype != f.dtype:
                raise ValueError(f"plan field {f.name}: {a.dtype}{list(a.shape)}, expected "
                                 f"{np.dtype(f.dtype)}{list(shape)}")
            flat = np.ascontiguousarray(a).reshape(-1).view(np.int32)
            buf[off:off + flat.size] = flat
            off += flat.size
        return buf

    def stop(self) -> np.ndarray:
        buf = np.zeros(self.size, np.int32)
        buf[:2] = (_MAGIC, 1)
        return buf

    def unpack(self, buf: np.ndarray):
        """-> (arrays, max_q_len, num_logprobs, filtered), or None for the stop message."""
        buf = np.asarray(buf)
        if buf.shape != (self.size,) or buf.dtype != np.int32 or int(buf[0]) != _MAGIC:
            raise ValueError("not a plan buffer of this codec")
        if buf[1]:
            return None
        dims = dict(zip(_DIMS, (int(x) for x in buf[2:2 + len(_DIMS)])))
        max_q_len, num_logprobs, filtered = (int(x) for x in buf[2 + len(_DIMS):_HEADER])
        arrays, off = {}, _HEADER
        for f in _FIELDS:
            shape = f.extent(dims)
            n = int(np.prod(shape))
            arrays[f.name] = buf[off:off + n].copy().view(f.dtype).reshape(shape)
            off += n
        return arrays, max_q_len, num_logprobs, bool(filtered)


class PlanChannel:
    """The leader's `send` and the followers' `recv` of step plans, over
    `broadcast(buffer, is_source)` (default: `multihost_utils.broadcast_one_to_all`, which is a
    local copy with one process, so a lone process sends to nobody)."""

    def __init__(self, codec: PlanCodec, broadcast: Callable | None = None):
        from jax.experimental import multihost_utils

        self.codec = codec
        self._injected = broadcast is not None
        self._broadcast = broadcast or multihost_utils.broadcast_one_to_all

    def _active(self) -> bool:
        return self._injected or jax.process_count() > 1

    def send(self, arrays: dict, max_q_len: int, num_logprobs: int, filtered: bool) -> None:
        buf = self.codec.pack(arrays, max_q_len, num_logprobs, filtered)
        if self._active():
            self._broadcast(buf, is_source=True)

    def send_stop(self) -> None:
        if self._active():
            self._broadcast(self.codec.stop(), is_source=True)

    def recv(self):
        buf = self._broadcast(np.zeros(self.codec.size, np.int32), is_source=False)
        return self.codec.unpack(np.asarray(buf))
