"""A GRPO-style RL loop with the engine as its sampler, updated in place every step.

    python -m jaxinfer.tools.grpo_example                     # a tiny model it makes itself
    python -m jaxinfer.tools.grpo_example --model DIR --steps 40 --out curve.json

The task, with a verifiable reward: the prompt "sum N =" asks for 4 digits (sampling allows only
the 10 digit tokens) that add up to N; the reward is 1 - |sum - N| / 10. Each step samples
`--samples` seeded completions per prompt through `LLM.generate` (with their logprobs), takes
each group's rewards relative to its mean (GRPO's advantage), and takes one optax step on the
clipped policy-gradient objective whose old logprobs are the ones the rollout reported; the
trainer's logprobs come from `LLM.logprob_fn()` (runtime/device/scoring.py: the engine's
forward as a pure function) on the model's own parameter layout (`LLM.get_weights()`), and
`LLM.update_weights` puts the new weights in the engine. `--batch-invariant`: the rollout's
logprobs equal the trainer's bit for bit (else within ~1e-6). Every step after the first compiles nothing (counted from jax's compile events) and the
mean reward rises. Prints one line per step; `--out` writes the curve as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

DIGITS = 4  # completion length


def _digit_ids(tokenizer) -> list[int]:
    """The token id of each digit 0-9 (the tokenizer must hold them as single tokens)."""
    ids = []
    for d in range(10):
        enc = [t for t in tokenizer.encode(f"x{d}", add_special_tokens=False)]
        if not enc or tokenizer.decode([enc[-1]]).strip() != str(d):
            raise SystemExit(f"the tokenizer has no single token for the digit {d}")
        ids.append(enc[-1])
    return ids


class CompileCounter:
    """XLA compilations in this process (jax's backend-compile events), from its creation."""

    def __init__(self):
        import jax

        self.n = 0
        jax.monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, name, secs, **_):
        if name == "/jax/core/compile/backend_compile_duration":
            self.n += 1

    def close(self):
        import jax

        jax.monitoring.unregister_event_duration_listener(self._on)


def run(model: str | None = None, steps: int = 60, samples: int = 16,
        targets: tuple[int, ...] = (6, 12, 18, 24), lr: float = 0.003, clip: float = 0.2,
        kl: float = 0.04, seed: int = 0, batch_invariant: bool = False, log=print) -> dict:
    """The loop; returns {"rewards": [mean reward per step], "compiles": [per step],
    "step_s": [...], "max_logprob_gap": [max |rollout - trainer| logprob per step]}."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from jaxinfer.runtime.host.requests import SamplingParams
    from jaxinfer.runtime.llm import LLM

    if model is None:
        from jaxinfer.tools.make_test_model import make

        model = str(make(tempfile.mkdtemp(prefix="grpo-model-"), "tiny", seed=seed))
    n_req = len(targets) * samples
    llm = LLM(model, max_slots=n_req, page_size=8, max_model_len=64, enable_prefix_caching=False,
              batch_invariant=batch_invariant)
    tok, cfg = llm.tokenizer, llm.model.cfg
    digits = _digit_ids(tok)
    value = np.zeros(cfg.vocab_size, np.int32)
    value[digits] = np.arange(10)
    prompts = [tok.encode(f"sum {n} =") for n in targets]
    plen = max(len(p) for p in prompts)
    prompts = [[p[0]] * (plen - len(p)) + p for p in prompts]  # one length: one trainer shape
    on_device = lambda tree: jax.device_put(tree, jax.devices()[0])  # noqa: E731 (committed,
    params = on_device(llm.get_weights())  # as train_step's outputs: one program for both)
    opt = optax.adam(lr)
    state = on_device(opt.init(params))

    ref = params  # the KL term's reference policy: the weights the run starts from
    sequence_logprobs = llm.logprob_fn()  # the engine's forward as a pure function of params

    def loss_fn(p, tokens, old_lp, ref_lp, adv):
        lp = sequence_logprobs(p, tokens)[:, plen - 1:]  # [B, DIGITS]
        ratio = jnp.exp(lp - old_lp)
        obj = jnp.minimum(ratio * adv[:, None],
                          jnp.clip(ratio, 1 - clip, 1 + clip) * adv[:, None])
        d = ref_lp - lp  # KL(policy || reference) per token, the k3 estimator
        return -(obj - kl * (jnp.exp(d) - d - 1)).mean(), lp

    # the trainer's forward alone (inside value_and_grad, XLA may fuse it otherwise: up to
    # ~5e-7 apart even in batch-invariant mode)
    forward = jax.jit(lambda p, tokens: sequence_logprobs(p, tokens)[:, plen - 1:])

    @jax.jit
    def train_step(p, s, tokens, old_lp, adv):
        ref_lp = sequence_logprobs(ref, tokens)[:, plen - 1:]
        (loss, lp), g = jax.value_and_grad(loss_fn, has_aux=True)(p, tokens, old_lp, ref_lp,
                                                                  adv)
        upd, s = opt.update(g, s, p)
        return optax.apply_updates(p, upd), s, loss, lp

    counter, out = CompileCounter(), {"rewards": [], "compiles": [], "step_s": [],
                                      "max_logprob_gap": []}
    try:
        for step in range(steps):
            t0, c0 = time.perf_counter(), counter.n
            sps = [SamplingParams(max_tokens=DIGITS, min_tokens=DIGITS, temperature=1.0,
                                  allowed_token_ids=digits, logprobs=0, ignore_eos=True,
                                  seed=seed * 1_000_003 + step * n_req + i)
                   for i in range(n_req)]
            outs = llm.generate([p for p in prompts for _ in range(samples)], sps)
            comp = np.array([o.token_ids for o in outs], np.int32)  # [B, DIGITS]
            old_lp = np.array([[e["logprob"] for e in o.logprobs] for o in outs], np.float32)
            want = np.repeat(np.asarray(targets), samples)
            reward = 1 - np.abs(value[comp].sum(1) - want) / 10  # [B]
            groups = reward.reshape(len(targets), samples)
            adv = (groups - groups.mean(1, keepdims=True)) / (groups.std(1, keepdims=True) + 1e-6)
            tokens = np.concatenate([np.repeat(np.asarray(prompts, np.int32), samples, 0), comp], 1)
            lp = forward(params, tokens)  # [B, DIGITS]: what the trainer's model says
            params, state, loss, _ = train_step(params, state, tokens, old_lp,
                                                 adv.reshape(-1).astype(np.float32))
            llm.update_weights(params)
            out["rewards"].append(float(reward.mean()))
            out["compiles"].append(counter.n - c0)
            out["step_s"].append(time.perf_counter() - t0)
            out["max_logprob_gap"].append(float(np.abs(np.asarray(lp) - old_lp).max()))
            log(f"step {step:3d}  reward {reward.mean():.3f}  loss {float(loss):+.4f}  "
                f"compiles {out['compiles'][-1]}  {out['step_s'][-1]:.2f} s  "
                f"|rollout - trainer| logprob {out['max_logprob_gap'][-1]:.1e}")
    finally:
        counter.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxinfer.tools.grpo_example",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a checkpoint dir (default: a tiny model made here)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--samples", type=int, default=16, help="completions per prompt")
    ap.add_argument("--lr", type=float, default=0.003)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-invariant", action="store_true",
                    help="the engine's batch-invariant mode: the rollout's logprobs equal the "
                         "trainer's bit for bit")
    ap.add_argument("--out", help="write the curve (rewards, compiles, step times) as JSON")
    a = ap.parse_args(argv)
    if a.steps < 1 or a.samples < 2:
        ap.error("--steps must be >= 1 and --samples >= 2 (a group needs two samples)")
    out = run(a.model, a.steps, a.samples, lr=a.lr, seed=a.seed,
              batch_invariant=a.batch_invariant)
    r = out["rewards"]
    k = max(1, len(r) // 5)
    print(f"mean reward: first {k} steps {sum(r[:k]) / k:.3f}, last {k} {sum(r[-k:]) / k:.3f}; "
          f"compiles after step 1: {sum(out['compiles'][1:])}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
