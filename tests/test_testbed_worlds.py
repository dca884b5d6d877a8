"""The testbed's worlds where DIFFERENT spec fields carry the reward (issue 30, part 3; lemon.testbed.world): exact optima,
which edit families' contrasts pay on each optimum, and the best single fixed spec of the mixed world.

Every number here is exact (lemon.testbed.world enumerates outcome distributions; no sampling); the constants were computed
by this very code (2026-12-04) and are what the worlds' comments claim. Reward: the trainer's default (gated) with
max_agents 3 as the smoke preset trains them; caps fitted to the sim as lemon.testbed.experiment.train_config fits them."""
import pytest

from lemon.prompts import default_prompts
from lemon.run.executor import ExecutorCaps
from lemon.spec import parse_spec
from lemon.testbed.world import best_fixed, duty_world, edge_world, mixed_world, tiny_world
from lemon.train.edits import FAMILIES, apply_edit, eligible_sites
from lemon.train.rewards import RewardConfig

P = default_prompts()
MAX_AGENTS = 3


def _setup(world):
    worst = world.worst_tokens(MAX_AGENTS)
    caps = ExecutorCaps(max_agents=MAX_AGENTS, max_tokens=world.worker_max_tokens(), task_token_budget=worst)
    return RewardConfig(max_agents=MAX_AGENTS, token_budget=worst), caps


def _contrasts(world, example, spec=None):
    """{family: [delta of each eligible edit of `spec` (default: the optimum)]}: E[r(spec)] - E[r(edited spec)]."""
    reward, caps = _setup(world)
    opt = world.optimum(example, reward, MAX_AGENTS, caps)
    spec = spec or opt.spec
    base = world.expected_reward(spec, example, reward, caps)
    out = {}
    for f in FAMILIES:
        out[f] = [base - world.expected_reward(apply_edit(spec, f, site, P).spec, example, reward, caps)
                  for site in eligible_sites(spec, f, P)]
    return opt, out


@pytest.mark.parametrize("build, optimum, pays, min_pay, idle", [
    (tiny_world, 0.9522, {"capacity"}, 0.05, set()),          # capacity pays (the original testbed)
    (duty_world, 0.9628, {"role"}, 0.3, {"capacity"}),        # role / duty decides; capacity edits change nothing
    (edge_world, 0.9700, {"edge"}, 0.3, {"capacity", "role"}),  # the solver -> verifier edge decides
])
def test_each_world_pays_through_its_field(build, optimum, pays, min_pay, idle):
    world = build(P, n=40) if build is not mixed_world else build(P)
    ex = world.examples()[0]
    opt, deltas = _contrasts(world, ex)
    print(build.__name__, round(opt.expected_reward, 4), opt.spec.to_yaml(), {f: [round(d, 4) for d in v]
                                                                            for f, v in deltas.items()})
    assert opt.expected_reward == pytest.approx(optimum, abs=1e-4)
    for f in pays:
        assert deltas[f] and max(deltas[f]) > min_pay, (f, deltas[f])  # an edit of this field costs
    # the idle fields, on the optimum with every agent at the large capacity (so capacity edits have somewhere to go):
    # same expected reward, and no edit of those fields changes it
    big = parse_spec(opt.spec.to_yaml().replace("capacity: small", "capacity: large"), base_roles=P.roles_for("math"))
    _, on_big = _contrasts(world, ex, big)
    for f in idle:
        assert on_big[f] and all(abs(d) < 1e-9 for d in on_big[f]), (f, on_big[f])  # editing this field costs nothing


def test_mixed_world_needs_a_policy_that_reads_the_question():
    world = mixed_world(P)
    reward, caps = _setup(world)
    exs = {t: next(e for e in world.examples() if world.type_of(e) == t) for t in world.config.types}
    optima = {t: world.optimum(e, reward, MAX_AGENTS, caps) for t, e in exs.items()}
    caps_used = {t: {a.capacity for a in o.spec.agents} for t, o in optima.items()}
    assert caps_used["specialist"] != caps_used["general"]  # the optimal specs differ by task type
    spec, per_type, regret = best_fixed(world, reward, MAX_AGENTS, caps)
    print({t: round(o.expected_reward, 4) for t, o in optima.items()}, {t: round(v, 4) for t, v in per_type.items()},
          round(regret, 4), spec.to_yaml())
    assert {t: round(o.expected_reward, 4) for t, o in optima.items()} == {"specialist": 1.0894, "general": 1.0793}
    assert regret == pytest.approx(0.2973, abs=1e-4)
    assert regret > 0.15  # issue 30: the best single fixed spec is far from the per-type optimum
