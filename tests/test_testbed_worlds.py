"""The testbed's worlds where DIFFERENT spec fields carry the reward (issue 30, part 3; lemon.testbed.world): exact
optima, which edit families' contrasts pay on each optimum, and the best single fixed spec of the mixed world.

Every number here is exact (lemon.testbed.world enumerates outcome distributions; no sampling); the constants were
computed by this very code (2026-12-04) and are what the worlds' comments claim. Reward: the trainer's default (gated)
with max_agents 3 as the smoke preset trains them; caps fitted to the sim as lemon.testbed.experiment.train_config fits
them."""
import pytest

from lemon.prompts import default_prompts
from lemon.run.executor import ExecutorCaps
from lemon.spec import parse_spec
from lemon.testbed.world import best_fixed, duty_world, edge_world, mixed_world, multi_world, tiny_world
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
    (multi_world, 0.9287, {"edge", "role", "capacity"}, 0.02, set()),  # every field pays (capacity / duty modestly)
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


def _duty_spec(duty: str):
    return parse_spec(f'agents:\n  - id: a1\n    base_role: solver\n    role: "S"\n    duty: "{duty}"\n    '
                      f'capacity: large\n    depends_on: []\nfinal: a1\n', base_roles=P.roles_for("math"))


def test_a_duty_pays_only_when_it_names_what_the_world_rewards_so_role_edits_cut_both_ways():
    """The duty world rewards a solver duty naming 're'; the default duty is neutral; any other customized duty costs.
    So the role edit (m_R: duty -> the base role's default) has a NEGATIVE delta on a duty that names nothing (under the
    old rule every customized duty paid and no m_R delta was ever negative)."""
    world = duty_world(P, n=5)
    reward, caps = _setup(world)
    ex = world.examples()[0]
    named, off, default = _duty_spec("Prepare it"), _duty_spec("Be brief"), _duty_spec(P.default_duty("solver"))
    p = {k: world.evaluate(s, ex, reward, caps).p_success for k, s in
         {"named": named, "off": off, "default": default}.items()}
    assert p == pytest.approx({"named": 0.85, "off": 0.05, "default": 0.25})
    deltas = {}
    for name, spec in (("named", named), ("off", off)):
        (site,) = eligible_sites(spec, "role", P)
        edited = apply_edit(spec, "role", site, P).spec
        deltas[name] = world.expected_reward(spec, ex, reward, caps) - world.expected_reward(edited, ex, reward, caps)
    assert deltas["named"] > 0.1 and deltas["off"] < -0.05, deltas


def test_the_simulated_workers_read_a_duty_as_the_exact_evaluation_does():
    """The executor on the SIMULATED pool (what sampled scoring runs) and SimWorld.evaluate agree on each duty's effect:
    the mean success of 400 seeded executions is within 4 standard errors of the exact probability."""
    from lemon.benchmarks import get_benchmark
    from lemon.run.executor import execute
    world = duty_world(P, n=5)
    reward, caps = _setup(world)
    ex, pool = world.examples()[0], world.pool()
    for duty in ("Prepare it", "Be brief", P.default_duty("solver")):
        spec = _duty_spec(duty)
        p = world.evaluate(spec, ex, reward, caps).p_success
        got = sum(execute(spec, ex, get_benchmark("gsm8k"), pool, prompts=P, caps=caps, seed=k).score
                  for k in range(400)) / 400
        assert abs(got - p) < 4 * (p * (1 - p) / 400) ** 0.5 + 1e-9, (duty, got, p)


def test_sim_config_round_trips_and_old_records_read_back_with_the_lenient_rule():
    from lemon.testbed.sim import SimConfig, duty_effect
    cfg = duty_world(P, n=5).config
    assert SimConfig.from_dict(cfg.to_dict()) == cfg
    old = {k: v for k, v in cfg.to_dict().items() if k not in ("duty_words", "off_duty_penalty")}
    legacy = SimConfig.from_dict(old)
    assert duty_effect("solve", "Be brief", P.default_duty("solver"), legacy) == 1  # any customized duty paid
    with pytest.raises(ValueError, match="duty_words"):
        SimConfig(types=cfg.types, benchmark_type=cfg.benchmark_type, duty_words={"solve": ("RE",)})


def test_an_experiment_record_rescores_in_the_world_it_was_run_in():
    """A record written before the duty rule rebuilds the lenient world (its rollouts re-score as they were trained);
    a current record gets the named world. (Checked by hand on outputs/reference/cf-seeds-30step-20261205: the study
    re-run from its files reproduces all 685 recorded values.)"""
    from lemon.testbed.experiment import world_of_record
    cur = duty_world(P, n=5).config.to_dict()
    old = {k: v for k, v in cur.items() if k not in ("duty_words", "off_duty_penalty")}
    assert world_of_record({"config": {"world": "duty"}, "world": {"config": cur}}, P).config.duty_words
    legacy = world_of_record({"config": {"world": "duty"}, "world": {"config": old}}, P)
    assert not legacy.config.duty_words and legacy.config.solve_duty_bonus == 0.6
