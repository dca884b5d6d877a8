"""Exact scoring for the testbed: each rollout (and each counterfactual edit) is rewarded with its EXACT expected reward
in the simulated world instead of one sampled outcome.

Why: with one sampled outcome per rollout, a group of G specs that each succeed with p ~0.05-0.5 is all-fail (no reward
spread, no gradient) most of the time under the gated reward, and a 135M policy at 4 samples per step cannot tell a real
improvement from outcome noise (LOG.md, 2026-12-01: 8 steps moved the held-out expected reward 0.07 -> 0.15, inside
the noise). The world knows E[r(y) | spec] in closed form (lemon.testbed.world.SimWorld.evaluate), so the trainer can be
given it: the expected value of what the sampled scorer would return, with zero outcome variance. What stays real: the
policy, its sampling (grammar included), the parser, the edits, the span mapping, the advantages and the TRL trainer.
What changes: no worker call is made (the executor and node cache are bypassed), so this mode measures credit assignment
under a noise-free reward, not robustness to outcome noise — `scoring="sampled"` (the executor + simulated pool) keeps
that arm. Both the global advantage and the counterfactual delta r(y) - r(y') become exact, for every arm alike.
"""
from __future__ import annotations

from dataclasses import dataclass

from lemon.train.rewards import RewardBreakdown, compute_reward
from lemon.train.scoring import SpecScorer


@dataclass(frozen=True)
class ExactTrace:
    """The part of lemon.run.executor.Trace the scorer reads. tokens = 0: nothing ran (no worker tokens spent)."""

    score: float  # P(success): the expected benchmark score
    nominal_tokens: int  # the spec's nominal worker tokens in the sim (deterministic)
    tokens: int = 0
    error: str | None = None


class ExactScorer(SpecScorer):
    """A SpecScorer whose `_execute` asks the world for the spec's exact expected reward (see the module docstring)."""

    def __init__(self, *args, world, **kw):
        super().__init__(*args, **kw)
        self.world = world

    def _execute(self, spec, ex, step: int):
        ev = self.world.evaluate(spec, ex, self.reward_cfg, self.caps)
        # efficiency and graph cost from the project's reward (they do not depend on the outcome); total = E[reward]
        terms = compute_reward(spec, 0.0, ev.tokens, self.reward_cfg)
        r = RewardBreakdown(ev.expected_reward, ev.p_success, terms.token_efficiency, terms.graph_cost, True, ev.tokens)
        return ExactTrace(ev.p_success, ev.tokens), r


def exact_scorer_factory(world):
    """`scorer_factory` for lemon.train.pipeline.train: builds an ExactScorer with the trainer's own arguments."""
    def factory(*args, **kw):
        return ExactScorer(*args, world=world, **kw)
    factory.name = "ExactScorer (lemon.testbed.exact: exact expected reward, no worker calls)"
    return factory
