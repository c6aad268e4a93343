"""The vision encoder on one device vs split over several (tensor parallel: VISION_AXES): one
image a call, the tower's shape from cost_model.VISION_MODELS (random weights), its first call
and the median of steady calls apart, and the largest difference of the two outputs.

    python -m jaxinfer.tools.bench_vision --layers 3 --devices 2      # CPU: host devices

On CPU the devices are host devices (XLA_FLAGS=--xla_force_host_platform_device_count, set here
before JAX starts). `--tiny`: a 2-layer 32-wide tower (a smoke run).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="Gemma-3-4B vision", help="a cost_model.VISION_MODELS key")
    ap.add_argument("--layers", type=int, default=3, help="layers of the tower to run")
    ap.add_argument("--devices", type=int, default=2, help="devices the split tower runs on")
    ap.add_argument("--repeats", type=int, default=3, help="steady calls (median)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--tiny", action="store_true", help="a 2-layer 32-wide tower")
    ap.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    return ap.parse_args(argv)


def _timed(fn, params, x, repeats: int):
    import numpy as np

    t0 = time.perf_counter()
    out = np.asarray(fn(params, x))
    first = time.perf_counter() - t0
    steady = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.asarray(fn(params, x))
        steady.append(time.perf_counter() - t0)
    return first, statistics.median(steady), out


def main(argv=None) -> dict:
    a = _args(argv)
    flag = f"--xla_force_host_platform_device_count={a.devices}"
    if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxinfer.runtime.device.sharding import VISION_AXES, make_mesh, replicated, shard_params
    from jaxinfer.runtime.device.vision import VisionConfig, encode_images, init_vision_params
    from jaxinfer.tools.cost_model import VISION_MODELS

    fields = dict(VISION_MODELS[a.model], num_layers=a.layers)
    if a.tiny:
        fields.update(image_size=32, patch_size=4, hidden_size=32, num_layers=2, num_heads=2,
                      intermediate_size=64, tokens_per_image=16, text_hidden_size=64)
    cfg = VisionConfig(**fields)
    params = init_vision_params(cfg, jax.random.key(0), getattr(jnp, a.dtype))
    px = np.random.default_rng(0).standard_normal(
        (1, cfg.image_size, cfg.image_size, 3)).astype(np.float32)
    fn = jax.jit(functools.partial(encode_images, cfg=cfg))
    one = _timed(fn, jax.device_put(params, jax.devices()[0]),
                 jax.device_put(px, jax.devices()[0]), a.repeats)
    mesh = make_mesh(a.devices)
    split = _timed(fn, shard_params(params, mesh, table=VISION_AXES),
                   jax.device_put(px, replicated(mesh)), a.repeats)
    row = dict(model=a.model, layers=cfg.num_layers, dtype=a.dtype, platform=jax.default_backend(),
               devices=a.devices, one_first_s=round(one[0], 3), one_steady_s=round(one[1], 3),
               split_first_s=round(split[0], 3), split_steady_s=round(split[1], 3),
               speedup=round(one[1] / split[1], 3),
               max_abs_diff=float(np.abs(one[2] - split[2]).max()))
    if a.json:
        print(json.dumps(row))
    else:
        print(f"{a.model}, {cfg.num_layers} layers, {a.dtype}, one {cfg.image_size}-pixel image "
              f"({row['platform']}; medians of {a.repeats}):")
        print(f"  one device:        first {row['one_first_s']:.2f} s, steady "
              f"{row['one_steady_s']:.2f} s")
        print(f"  split over {a.devices}:      first {row['split_first_s']:.2f} s, steady "
              f"{row['split_steady_s']:.2f} s  ({row['speedup']:.2f}x, max |diff| "
              f"{row['max_abs_diff']:.1e})")
    return row


if __name__ == "__main__":
    main()
