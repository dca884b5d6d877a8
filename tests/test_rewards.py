"""The reward's case table (lemon.train.rewards docstring), one test per row, in both forms; and its order
guarantees."""
import itertools

import pytest

from lemon.spec import parse_spec
from lemon.train.rewards import RewardConfig, compute_reward, graph_cost

ONE = "agents:\n  - {id: a, base_role: solver, role: A, duty: Do it., capacity: small}\n"
FOUR = ("agents:\n  - {id: a, base_role: planner, role: A, duty: x., capacity: small}\n"
        "  - {id: b, base_role: solver, role: B, duty: y., capacity: large, depends_on: [a]}\n"
        "  - {id: c, base_role: critic, role: C, duty: z., capacity: small, depends_on: [a, b]}\n"
        "  - {id: d, base_role: decider, role: D, duty: w., capacity: medium, depends_on: [a, b, c]}\n")
CFG = dict(w_success=1.0, w_tokens=0.2, w_graph=0.1, token_budget=1000, max_agents=4)


@pytest.mark.parametrize("form", ["gated", "paper"])
def test_invalid_spec_gets_r_invalid(form):
    cfg = RewardConfig(form=form, **CFG)
    r = compute_reward(None, 0.0, 0, cfg)
    assert r.total == cfg.r_invalid and not r.valid


@pytest.mark.parametrize("form", ["gated", "paper"])
def test_errored_execution_is_not_rewarded(form):
    r = compute_reward(parse_spec(ONE), 0.0, 120, RewardConfig(form=form, **CFG), errored=True)
    assert r.total is None and r.errored and r.valid


def test_valid_wrong_answer():
    spec = parse_spec(FOUR)
    assert compute_reward(spec, 0.0, 400, RewardConfig(form="gated", **CFG)).total == 0.0
    paper = compute_reward(spec, 0.0, 400, RewardConfig(form="paper", **CFG))
    assert paper.total == pytest.approx(0.2 * 0.6 - 0.1 * graph_cost(spec, RewardConfig(**CFG)))


@pytest.mark.parametrize("form", ["gated", "paper"])
def test_valid_right_answer(form):
    spec, cfg = parse_spec(ONE), RewardConfig(form=form, **CFG)
    r = compute_reward(spec, 1.0, 250, cfg)
    assert r.success == 1.0 and r.token_efficiency == pytest.approx(0.75)
    assert r.total == pytest.approx(1 + 0.2 * 0.75 - 0.1 * r.graph_cost)


def test_partial_score():
    spec = parse_spec(ONE)
    g = compute_reward(spec, 0.5, 250, RewardConfig(form="gated", **CFG))
    p = compute_reward(spec, 0.5, 250, RewardConfig(form="paper", **CFG))
    assert g.total == pytest.approx(0.5 * (1 + 0.2 * 0.75 - 0.1 * g.graph_cost))
    assert p.total == pytest.approx(0.5 + 0.2 * 0.75 - 0.1 * p.graph_cost)
    with pytest.raises(ValueError, match="score"):
        compute_reward(spec, 1.5, 0, RewardConfig(**CFG))


@pytest.mark.parametrize("form", ["gated", "paper"])
def test_a_failure_never_outscores_a_success_and_invalid_is_lowest(form):
    cfg = RewardConfig(form=form, **CFG)
    specs = [parse_spec(ONE), parse_spec(FOUR)]
    fails = [compute_reward(s, 0.0, t, cfg).total for s, t in itertools.product(specs, (0, 300, 10**6))]
    wins = [compute_reward(s, 1.0, t, cfg).total for s, t in itertools.product(specs, (0, 300, 10**6))]
    assert max(fails) < min(wins)
    assert compute_reward(None, 0.0, 0, cfg).total < min(fails)


def test_gated_form_does_not_prefer_the_cheapest_failing_spec():
    """The issue's complaint: in the paper form a cheap failing spec beats an expensive failing one, so a group with no
    success pulls toward the cheapest spec; gated, all failures tie (zero spread, no gradient)."""
    one, four = parse_spec(ONE), parse_spec(FOUR)
    paper = RewardConfig(form="paper", **CFG)
    assert compute_reward(one, 0.0, 100, paper).total > compute_reward(four, 0.0, 900, paper).total
    gated = RewardConfig(form="gated", **CFG)
    assert compute_reward(one, 0.0, 100, gated).total == compute_reward(four, 0.0, 900, gated).total


def test_config_checks():
    with pytest.raises(ValueError, match="r_invalid"):
        RewardConfig(r_invalid=0.0)
    with pytest.raises(ValueError, match="token_budget"):
        RewardConfig(token_budget=0)
    with pytest.raises(ValueError, match="w_tokens"):
        RewardConfig(w_success=0.3, w_tokens=0.3)
    with pytest.raises(ValueError, match="form"):
        RewardConfig(form="mine")
    # graph cost is normalised by the training max_agents: a 4-agent complete DAG costs more at max_agents=4 than at 8
    four = parse_spec(FOUR)
    assert graph_cost(four, RewardConfig(max_agents=4)) > 2 * graph_cost(four, RewardConfig(max_agents=8))
