"""The learning test at CI size (issue 28): CF-GRPO training improves a policy on a world whose optimum is known.

Everything but the policy's size is what `lemon train` runs: the real prompts, spec grammar (llguidance), parser, edit
families, span mapping, TRL GRPOTrainer with the CF mixin and its loss. The policy is a randomly initialised 2-layer
Qwen2 with the testbed's 2,048-token BPE (lemon.testbed.vocab; with SmolLM2's 49k tokenizer the test took ~4x longer);
the workers are the duty world's simulation, and every rollout and counterfactual is rewarded with its EXACT expected
reward (lemon.testbed.exact), so the only noise left is the policy's own sampling. The measure is deterministic: the
exact expected reward of the GREEDY specs on held-out questions, before training and after.

Sabotage check (issue 28: the test must fail when the advantage is zeroed or its sign flipped). LEMON_TEST_SABOTAGE=zero
or =flip multiplies the advantages the trainer hands to TRL's loss by 0 or -1 (the one place lemon.train.grpo computes
them):
    LEMON_TEST_SABOTAGE=flip .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_learning_tiny.py
Both fail (LOG.md 2026-12-07: +0.000 and -0.014). The 135M version of this test
(tests/test_testbed_learning.py, ~34 min) is `-m long`.
"""
import os

import pytest

pytest.importorskip("trl")

from lemon.prompts import default_prompts  # noqa: E402
from lemon.testbed.experiment import ExperimentConfig, collect, evaluate_heldout, run_arm, train_config  # noqa: E402
from lemon.testbed.stats import step_curves  # noqa: E402
from lemon.testbed.world import duty_world  # noqa: E402
from lemon.policy.model import PolicyConfig, random_policy  # noqa: E402
from lemon.testbed.vocab import small_tokenizer_dir  # noqa: E402

STEPS = 10
OVERRIDES = {"num_generations": 4, "batch_size": 8, "learning_rate": 2e-2, "resample": 0,
             "role_chars": 12, "duty_chars": 16, "curriculum": False}
INIT = 0.2  # weight init std of the random policy: at HF's 0.02 its logits span ~1 nat and LoRA cannot sharpen them
# held-out greedy expected reward, after minus before. Measured on the testbed BPE base (LOG.md 2026-12-07): +0.815
# (0.014 -> 0.830); sabotaged: zero +0.000, flip -0.014. The margin leaves room for another CPU's float rounding.
MIN_GAIN = 0.4


def _sabotage(monkeypatch):
    """Multiply the trainer's (B, T) advantages by 0 or -1 when LEMON_TEST_SABOTAGE asks (see the module docstring)."""
    how = os.environ.get("LEMON_TEST_SABOTAGE", "")
    if not how:
        return
    import lemon.train.grpo as G
    factor = {"zero": 0.0, "flip": -1.0}[how]
    real = G.rollout_advantages  # the one call that turns the trainer's rollout records into (B, T) advantages

    def sabotaged(*a, **k):
        adv, keep, scale = real(*a, **k)
        return adv * factor, keep, scale
    monkeypatch.setattr(G, "rollout_advantages", sabotaged)


@pytest.mark.timeout(600)
def test_cf_grpo_improves_a_tiny_policy_on_the_testbed(tmp_path, monkeypatch):
    _sabotage(monkeypatch)
    prompts = default_prompts()
    world = duty_world(prompts)
    policy = random_policy(small_tokenizer_dir(), tmp_path / "policy", initializer_range=INIT)
    over = {**OVERRIDES, "policy": PolicyConfig(model=str(policy), backend="transformers", lora_r=8, lora_alpha=16,
                                                dtype="fp32")}
    exp = ExperimentConfig(world="duty", profile="smoke", arms=("cf",), seeds=(0,), max_steps=STEPS, train_questions=16,
                           heldout_questions=8, eval_every=STEPS, train_overrides=over)
    run = tmp_path / "cf" / "seed-0"
    res = run_arm("cf", 0, run, world, exp, prompts, progress=False)
    assert res["steps"] == STEPS
    cfg = train_config("cf", 0, exp, world)
    assert evaluate_heldout(run, world, exp, prompts, cfg) == 2 * exp.heldout_questions

    held = step_curves(collect(tmp_path, world, "heldout")).set_index("step")
    samples = step_curves(collect(tmp_path, world, "rollouts")).set_index("step")
    print(held.to_string(), samples.to_string(), sep="\n")
    assert list(held.index) == [0, STEPS] and (held["valid"] == 1.0).all()  # grammar-constrained greedy specs
    gain = held.loc[STEPS, "expected_reward"] - held.loc[0, "expected_reward"]
    assert gain >= MIN_GAIN, (f"held-out greedy expected reward rose by {gain:+.3f} in {STEPS} steps "
                              f"(want >= {MIN_GAIN})")
    assert held.loc[STEPS, "regret"] < held.loc[0, "regret"]
    assert len(samples) == STEPS and (samples["n"] == OVERRIDES["batch_size"]).all()
