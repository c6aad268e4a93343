"""The RL example (tools/grpo_example.py): the engine samples, a trainer steps, update_weights
puts the new weights in place; the reward rises and no step after the first compiles."""

from __future__ import annotations


def test_reward_rises_with_no_compile_after_the_first_step(tiny_dir):
    from jaxinfer.tools.grpo_example import run

    lines = []
    out = run(str(tiny_dir), steps=40, log=lines.append)
    r = out["rewards"]
    first, last = sum(r[:10]) / 10, sum(r[-10:]) / 10
    assert last > first + 0.15, (first, last, r)
    assert out["compiles"][0] > 0 and sum(out["compiles"][1:]) == 0, out["compiles"]
    # the rollout's logprobs and the trainer's differ by float rounding only
    assert max(out["max_logprob_gap"]) < 1e-4
    assert len(lines) == 40 and lines[0].startswith("step   0")


def test_cli_refuses_a_group_of_one(capsys):
    import pytest

    from jaxinfer.tools.grpo_example import main

    with pytest.raises(SystemExit):
        main(["--samples", "1"])
    assert "--samples" in capsys.readouterr().err


def test_batch_invariant_rollouts_equal_the_trainers_logprobs(tiny_dir):
    from jaxinfer.tools.grpo_example import run

    out = run(str(tiny_dir), steps=3, samples=4, batch_invariant=True, log=lambda _: None)
    assert out["max_logprob_gap"] == [0.0, 0.0, 0.0]
