"""An expected-number test in nanochat's spirit (issue 13): CF-GRPO trains the REAL policy (SmolLM2-135M + LoRA, the
real prompts, grammar, parser, edits and TRL trainer) on the tiny known-optimum testbed, and its greedy specs on
held-out questions get better. Only the workers are simulated (lemon.testbed.sim); every rollout and CF edit is scored
with the world's exact expected reward (lemon.testbed.exact), so the one source of noise left is the policy's own
sampling.

Slow (~17 min on 2 idle cores): the format SFT warm start (~7 min; lemon.testbed.warm), 5 CF-GRPO steps of 2 questions x
G=4 (~90 s each) and two greedy held-out passes. The same configuration, run for 10 steps with 3 seeds per arm, is the
reference comparison in outputs/reference/testbed-tiny-20261202/ (experiments/testbed_run.py; its README names the
command).
"""
from dataclasses import replace

import pytest

from lemon.prompts import default_prompts
from lemon.testbed.experiment import ExperimentConfig, collect, evaluate_heldout, run_arm, train_config
from lemon.testbed.stats import step_curves
from lemon.testbed.warm import warm_start_adapter
from lemon.testbed.world import tiny_world

# Outside README's suite (issue 28: 2039 s on a 2-core AVX2 machine, more than CI can spend on one test):
#   .venv/bin/python -m pytest -q -p no:cacheprovider -m long tests/test_testbed_learning.py
pytestmark = [pytest.mark.slow, pytest.mark.long]

STEPS = 5
OVERRIDES = {"num_generations": 4, "batch_size": 8, "learning_rate": 2e-4, "resample": 0}
# Measured here (2026-12-02, seed 0, this configuration): +0.298 and +0.384 in two runs (LOG.md); the 6 reference runs'
# step-5 gains (10-step schedule) were 0.18-0.37. The margin asked for is under all of them.
MIN_GAIN = 0.15


@pytest.mark.timeout(2400)  # ~17 min on 2 idle cores: SFT ~7, 5 steps ~8, two greedy passes ~1.5
def test_cf_grpo_improves_the_policy_on_the_tiny_testbed(tmp_path):
    prompts = default_prompts()
    world = tiny_world(prompts)
    exp = ExperimentConfig(world="tiny", profile="smoke", arms=("cf",), seeds=(0,), max_steps=STEPS, train_questions=16,
                           heldout_questions=8, eval_every=STEPS, train_overrides=OVERRIDES)
    exp = replace(exp, init_adapter=str(warm_start_adapter(exp, world, prompts, tmp_path / "sft", progress=False)))
    run = tmp_path / "cf" / "seed-0"
    res = run_arm("cf", 0, run, world, exp, prompts, progress=False)
    assert res["steps"] == STEPS
    assert evaluate_heldout(run, world, exp, prompts, train_config("cf", 0, exp, world)) == 2 * exp.heldout_questions

    held = step_curves(collect(tmp_path, world, "heldout")).set_index("step")
    samples = step_curves(collect(tmp_path, world, "rollouts")).set_index("step")
    print(held.to_string(), samples.to_string(), sep="\n")
    assert list(held.index) == [0, STEPS] and (held["n"] == exp.heldout_questions).all()
    assert held.loc[0, "valid"] == 1.0 and held.loc[STEPS, "valid"] == 1.0  # grammar-constrained greedy specs
    gain = held.loc[STEPS, "expected_reward"] - held.loc[0, "expected_reward"]
    assert gain >= MIN_GAIN, (f"held-out greedy expected reward rose by only {gain:+.3f} in {STEPS} steps "
                              f"(want >= {MIN_GAIN})")
    assert held.loc[STEPS, "regret"] < held.loc[0, "regret"]
    # every step trained on a full batch of scored samples
    assert len(samples) == STEPS and (samples["n"] == OVERRIDES["batch_size"]).all()
