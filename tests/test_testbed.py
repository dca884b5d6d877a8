"""The known-optimum testbed (lemon.testbed): the sim's table, its reading of the executor's real messages, exact
expected reward vs Monte Carlo through the REAL executor, the pruned optimum search vs brute force, regret, and the
experiment's aggregation and plots on hand-written run folders."""
import json
import math
import random
from itertools import combinations, product

import pytest

from lemon.benchmarks import Example, extract_number, get_benchmark
from lemon.eval.orchestrator import orchestrator_messages
from lemon.prompts import CAPACITIES, default_prompts
from lemon.run.executor import ExecutorCaps, NodeCache, build_messages, execute
from lemon.run.workers import BackendUnavailableError
from lemon.spec import Agent, Spec, spec_from_dict
from lemon.testbed.experiment import (ARMS, ExperimentConfig, collect, split_examples, train_config, write_experiment,
                                      write_run_info)
from lemon.testbed.stats import (band, bootstrap_ci, composition, paired_table, step_curves, steps_to_threshold,
                                 summary_table)
from lemon.testbed.plots import write_report
from lemon.testbed.search import ROLE_OF, check_reward_properties
from lemon.testbed.sim import (KIND_OF, MAX_TAG_CHARS, MessageReader, Node, SimConfigError, SimProtocolError,
                               SimUnknownTaskError, draw, final_text, outcome_dist, tag)
from lemon.testbed.world import TWO_TYPES, tiny_world, two_type_world
from lemon.train.edits import apply_edit
from lemon.train.rewards import RewardConfig, compute_reward

P = default_prompts()
WORLD = two_type_world(P)
TINY = tiny_world(P, n=40)
HARD = next(e for e in WORLD.examples() if e.benchmark == "gsm8k")
EASY = next(e for e in WORLD.examples() if e.benchmark == "multiarith")
GSM = get_benchmark("gsm8k")
R = RewardConfig(max_agents=4)
EASY_T, HARD_T = TWO_TYPES.types["easy"], TWO_TYPES.types["hard"]


def A(aid, deps=(), cap="small", base="solver", duty="Do it carefully.", role=None):
    return {"id": aid, "base_role": base, "role": role or f"Role {aid}", "duty": duty, "capacity": cap,
            "depends_on": list(deps)}


def spec(*agents, final=None):
    return spec_from_dict({"agents": list(agents), "final": final or agents[-1]["id"]})


# ---- the model -------------------------------------------------------------------------------------------------------
def test_outcome_table():
    cfg = TWO_TYPES
    assert outcome_dist(Node("solve", "medium", True), [], HARD_T, cfg)["correct"] == pytest.approx(0.25 + 0.15)
    assert outcome_dist(Node("solve", "large", True), [("note", "none")], HARD_T, cfg)["correct"] == pytest.approx(0.8)
    assert outcome_dist(Node("solve", "large", False), [("solve", "correct")], HARD_T,
                        cfg)["correct"] == pytest.approx(0.55)
    assert outcome_dist(Node("solve", "medium", True), [], EASY_T, cfg) == {"correct": 1.0, "wrong": 0.0}  # clipped
    q = 0.5 + 0.1  # large checker, customized
    chk = Node("check", "large", True)
    assert outcome_dist(chk, [("solve", "wrong")], HARD_T, cfg)["correct"] == pytest.approx(q)
    assert outcome_dist(chk, [("solve", "correct")], HARD_T, cfg)["correct"] == 1.0
    assert outcome_dist(chk, [("solve", "correct"), ("solve", "wrong")], HARD_T,
                        cfg)["correct"] == pytest.approx(0.5 + 0.5 * q)
    assert outcome_dist(chk, [("note", "none")], HARD_T, cfg) == {"none": 1.0}  # a note gives no answer to check
    assert outcome_dist(Node("check", "small", False), [("solve", "wrong")], HARD_T, cfg)["correct"] == 0.0
    dec = Node("pass", "large", True)
    assert outcome_dist(dec, [("solve", "correct")] * 2 + [("check", "wrong")], HARD_T, cfg)["correct"] == 1.0
    assert outcome_dist(dec, [("solve", "correct")] + [("check", "wrong")] * 2, HARD_T, cfg)["correct"] == 0.0
    assert outcome_dist(Node("note", "large", True), [("solve", "correct")], HARD_T, cfg) == {"none": 1.0}
    assert outcome_dist(Node("idle", "large", True), [], HARD_T, cfg) == {"none": 1.0}
    assert set(KIND_OF) == set(P.roles_for("math")), "every math-domain base role has a kind in the sim's table"


def test_reader_reads_the_executor_messages():
    reader = MessageReader(P)
    parents = [("a1", "Solver (fast):", tag("wrong", "large", "solve")), ("a2", "Plan", tag("none", "small", "note"))]
    agent = Agent("a3", "verifier", "Checker", P.default_duty("verifier"), "medium", ("a1", "a2"))
    v = reader.read(build_messages(agent, parents, HARD.question, P))
    assert (v.task, v.kind, v.custom, v.final) == (HARD.question, "check", False, False)
    assert v.parents == [("solve", "wrong", "large"), ("note", "none", "small")]
    tricky = Agent("a3", "verifier", "Checker, a careful one", "Check.", "large", ())
    assert reader.read(build_messages(tricky, [], HARD.question, P)).kind == "check"
    final = Agent("a4", "decider", "D", "Answer it well.", "small", ())
    v = reader.read(build_messages(final, [], "Line one.\nLine two?", P, answer_convention=GSM.answer_convention))
    assert (v.task, v.kind, v.custom, v.final, v.parents) == ("Line one.\nLine two?", "pass", True, True, [])
    with pytest.raises(SimProtocolError):
        reader.read(orchestrator_messages(HARD.question, "math", P))
    with pytest.raises(SimProtocolError, match="not sim tags"):
        reader.read(build_messages(agent, [("a1", "S", "I think 42.")], HARD.question, P))


def test_replies_are_scored_by_the_real_scorer():
    for cap, kind in product(CAPACITIES, ("solve", "check", "pass", "note", "idle")):
        assert len(tag("correct", cap, kind)) <= MAX_TAG_CHARS
    ex = Example("t/1", "gsm8k", "train", "q", "1,250")
    assert GSM.score(ex, final_text("correct", "large", "solve", ex.gold, 3)) == 1.0
    assert all(GSM.score(ex, final_text("wrong", "large", "solve", ex.gold, k)) == 0.0 for k in range(1, 10))
    assert extract_number(final_text("none", "small", "note", ex.gold, 1)) is None


def test_backend_tokens_errors_and_draws():
    pool = WORLD.pool()
    s = spec(A("a1", cap="large"), A("a2", ["a1"], cap="medium", base="verifier"),
             A("a3", ["a1", "a2"], base="decider"))
    tr = execute(s, HARD, GSM, pool, prompts=P, seed=3)
    assert [(a.prompt_tokens, a.completion_tokens) for a in tr.agents] == [(400, 240), (640, 160), (800, 100)]
    assert tr.error is None and tr.nominal_tokens == WORLD.evaluate(s, HARD, R).tokens == 2340
    with pytest.raises(SimConfigError):  # a cap below the sim's reply length stops the run (never a silent score 0)
        execute(s, HARD, GSM, pool, prompts=P, caps=ExecutorCaps(max_tokens={"large": 100}))
    with pytest.raises(SimUnknownTaskError):
        execute(s, Example("x/1", "gsm8k", "train", "Not a task of this world.", "1"), GSM, pool, prompts=P)
    assert issubclass(SimUnknownTaskError, BackendUnavailableError)
    msgs = build_messages(s.agents[0], [], HARD.question, P)
    assert draw(5, "large", msgs) == draw(5, "large", msgs) != draw(5, "medium", msgs)
    # the same per-agent seed (fixed ids a1..an) but another capacity: independent draws, not a coupled threshold
    large, medium = spec(A("a1", cap="large")), spec(A("a1", cap="medium"))
    flips = sum(execute(medium, HARD, GSM, pool, prompts=P, seed=k).score > execute(large, HARD, GSM, pool, prompts=P,
                                                                                      seed=k).score for k in range(200))
    assert flips > 10  # expected 200 * 0.4 * 0.3 = 24 when independent, 0 when coupled


def test_node_cache_and_counterfactual_reexecution():
    pool, cache = WORLD.pool(), NodeCache()
    s = spec(A("a1", cap="large"), A("a2", ["a1"], cap="large", base="verifier"), A("a3", ["a2"], base="decider"))
    first = execute(s, HARD, GSM, pool, prompts=P, cache=cache, seed=7)
    again = execute(s, HARD, GSM, pool, prompts=P, cache=cache, seed=7)
    assert [a.output for a in again.agents] == [a.output for a in first.agents] and again.cache_hits == 3
    edit = apply_edit(s, "capacity", ("a2",), P)
    cf = execute(edit.spec, HARD, GSM, pool, prompts=P, cache=cache, seed=7)
    assert [a.cache_hit for a in cf.agents] == [True, False, False]  # only the edited agent and its descendant re-run


# ---- exact expected reward vs Monte Carlo through the real executor --------------------------------------------------
MC_CASES = {
    "tie vote + note + dead agent": (spec(A("a1", base="planner"), A("a2", ["a1"], cap="large"), A("a3", cap="medium"),
                                          A("a4", ["a2", "a3"], cap="medium", base="verifier"), A("a5", cap="large"),
                                          final="a4"), HARD, ExecutorCaps()),
    "checker chain, default duties": (spec(A("a1", cap="medium", duty=P.default_duty("solver")),
                                           A("a2", ["a1"], cap="large", base="critic"),
                                           A("a3", ["a2", "a1"], base="summarizer")), HARD, ExecutorCaps()),
    "easy, default duty": (spec(A("a1", duty=P.default_duty("solver"))), EASY, ExecutorCaps()),
    "over the task budget": (spec(A("a1", cap="large"), A("a2", ["a1"], cap="large", base="verifier")), HARD,
                             ExecutorCaps(task_token_budget=1000)),
}
FORMS = ["gated", "paper"] if "form" in RewardConfig.__dataclass_fields__ else [None]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", list(MC_CASES))
def test_expected_reward_matches_monte_carlo(case, form):
    s, ex, caps = MC_CASES[case]
    cfg = RewardConfig(max_agents=5, **({"form": form} if form else {}))
    ev, pool, n = WORLD.evaluate(s, ex, cfg, caps), WORLD.pool(), 400
    rewards = []
    for seed in range(n):
        tr = execute(s, ex, get_benchmark(ex.benchmark), pool, prompts=P, caps=caps, seed=seed)
        assert tr.error is None and tr.nominal_tokens == ev.tokens and tr.budget_exceeded == ev.budget_exceeded
        rewards.append(compute_reward(s, tr.score, tr.nominal_tokens, cfg).total)
    mean = sum(rewards) / n
    se = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1) / n)
    assert abs(mean - ev.expected_reward) <= 4 * se + 1e-9, (case, mean, ev.expected_reward, se)


# ---- the optimum search vs brute force -------------------------------------------------------------------------------
def _subsets(items):
    return [c for r in range(len(items) + 1) for c in combinations(items, r)]


def brute_force(world, example, cfg, max_agents, roles=tuple(ROLE_OF.values())):
    """max expected reward over EVERY spec of <= max_agents agents: any base role in `roles`, a duty that is the
    default, one the world rewards or one it does not (lemon.testbed.sim.duty_effect: 'Refine it.' names both 're' and
    'in', 'Be brief.' neither), any capacity, any dependencies, any final. Memoized on (agents that run, agent / edge /
    unreachable counts), which is everything the executor and the graph cost read."""
    variants = [(r, cap, duty) for r in roles for cap in CAPACITIES for duty in (None, "Refine it.", "Be brief.")]
    default = P.roles_for(None)
    best, memo = float("-inf"), {}
    for n in range(1, max_agents + 1):
        for vs in product(variants, repeat=n):
            for deps in product(*[_subsets(list(range(i))) for i in range(n)]):
                edges = sum(map(len, deps))
                for f in range(n):
                    live = {f}
                    for i in range(f, -1, -1):
                        if i in live:
                            live.update(deps[i])
                    key = (tuple((KIND_OF[vs[i][0]], vs[i][1:], deps[i]) for i in sorted(live)), n, edges,
                           n - len(live))
                    if key not in memo:
                        agents = tuple(Agent(f"a{i + 1}", r, "R", cu or default[r], cap,
                                             tuple(f"a{j + 1}" for j in d))
                                             for i, ((r, cap, cu), d) in enumerate(zip(vs, deps)))
                        memo[key] = world.expected_reward(Spec(agents, f"a{f + 1}"), example, cfg)
                    best = max(best, memo[key])
    return best


@pytest.mark.parametrize("world,example,max_agents", [(WORLD, HARD, 1), (WORLD, HARD, 2), (WORLD, HARD, 3),
                                                      (WORLD, EASY, 2), (TINY, TINY.examples()[0], 2)])
def test_optimum_matches_brute_force(world, example, max_agents):
    cfg = RewardConfig(max_agents=3)
    assert world.optimum(example, cfg, max_agents).expected_reward == pytest.approx(
        brute_force(world, example, cfg, max_agents), abs=1e-12)


def test_roles_of_one_kind_are_interchangeable():  # pruning argument P2, with every math-domain base role
    cfg = RewardConfig(max_agents=2)
    full = brute_force(WORLD, HARD, cfg, 2, roles=tuple(P.roles_for("math")))
    assert full == pytest.approx(brute_force(WORLD, HARD, cfg, 2), abs=1e-12)


def test_optimum_differs_by_type_and_reward_properties_are_checked():
    easy, hard = WORLD.optimum(EASY, R, 4), WORLD.optimum(HARD, R, 4)
    assert [(a.base_role, a.capacity) for a in easy.spec.agents] == [("solver", "small")] and easy.p_success == 1.0
    kinds = [(a.base_role, a.capacity) for a in hard.spec.agents]
    assert ("solver", "large") in kinds and ("verifier", "large") in kinds and hard.p_success > 0.9
    with pytest.raises(ValueError, match="R2"):  # a reward that pays for tokens would void the pruning
        check_reward_properties(lambda s, sc, t: sc + t / 1000, P)


def test_regret_and_batch_scoring():
    opt = WORLD.optimum(HARD, R, 4)
    assert WORLD.regret(opt.spec.text, HARD, R, 4) == pytest.approx(0.0, abs=1e-12)
    bad = WORLD.score_text("agents: [", HARD, R, 4)
    assert not bad.valid and bad.regret == pytest.approx(opt.expected_reward - compute_reward(None, 0.0, 0, R).total)
    weak = spec(A("a1", base="planner"), A("a2", ["a1"], cap="medium", base="solver")).to_yaml()
    scores = WORLD.score_texts([opt.spec.text, weak], [HARD.id, HARD.id], R, 4)
    assert scores[0].regret < 1e-12 < scores[1].regret and scores[1].valid
    with pytest.raises(SimUnknownTaskError):
        WORLD.score_texts([weak], ["nope"], R, 4)


def test_tiny_world_optimum_is_far_from_typical_specs():
    from lemon.train.sft import mutated_baseline  # the warm start's spec generator: what an SFT policy writes at first
    ex, rng = TINY.examples()[0], random.Random(0)
    typical = [mutated_baseline("math", ex.question, P, rng, max_agents=4) for _ in range(40)]
    regrets = [TINY.regret(s.to_yaml(), ex, R, 4) for s in typical]
    assert sum(regrets) / len(regrets) > 0.3 and min(regrets) >= -1e-12


# ---- the experiment's aggregation and plots on hand-written run folders ----------------------------------------------
def test_split_and_train_config():
    train, held = split_examples(WORLD, 20, 10, seed=0)
    assert not {e.id for e in train} & {e.id for e in held}
    assert sum(WORLD.type_of(e) == "easy" for e in train) == 10
    exp = ExperimentConfig()
    assert train_config("global", 1, exp, WORLD).cf_lambda == 0.0
    assert train_config("edge", 1, exp, WORLD).cf_families == ("edge",) and set(ARMS) >= set(exp.arms)
    cfg = train_config("cf", 0, ExperimentConfig(profile="smoke"), WORLD)  # 16-32 token replies: raised to the sim's
    assert cfg.worker_max_tokens == {"small": 100, "medium": 160, "large": 240} and cfg.max_agents == 3
    worst = spec(*[A(f"a{i}", [f"a{j}" for j in range(1, i)], cap="large") for i in range(1, 4)])
    assert WORLD.evaluate(worst, HARD, cfg.reward).tokens == cfg.reward.token_budget == WORLD.worst_tokens(3)


def _write_run(root, arm, seed, texts_by_step):
    d = root / arm / f"seed-{seed}"
    d.mkdir(parents=True)
    write_run_info(d, arm, seed, R, 4, ExecutorCaps(max_agents=4))
    with open(d / "rollouts.jsonl", "w") as f:
        for step, texts in texts_by_step.items():
            for t in texts:
                f.write(json.dumps({"step": step, "example_id": HARD.id, "text": t, "valid": True, "reward": 0.0,
                                    "family": None, "delta": None}) + "\n")
    return d


def test_aggregation_and_report(tmp_path):
    opt = WORLD.optimum(HARD, R, 4).spec.text
    weak = spec(A("a1", cap="medium"), A("a2", ["a1"], base="decider")).to_yaml()
    r_weak = WORLD.regret(weak, HARD, R, 4)
    # arm "cf" reaches the optimum at step 2 (seed 0) / 4 (seeds 1, 2); "global" stays at half optimum, half weak
    for seed, when in ((0, 2), (1, 4), (2, 4)):
        _write_run(tmp_path, "cf", seed, {s: [opt, opt] if s >= when else [weak, weak] for s in range(1, 7)})
        _write_run(tmp_path, "global", seed, {s: [opt, weak] for s in range(1, 7)})
    d = _write_run(tmp_path, "edge", 0, {1: [weak, "not a spec"]})
    (d / "heldout.jsonl").write_text(json.dumps({"step": 0, "example_id": HARD.id, "text": opt}) + "\n")
    curves = step_curves(collect(tmp_path, WORLD))
    g = curves[(curves.arm == "global")]
    assert g["regret"].tolist() == pytest.approx([r_weak / 2] * 18) and g["valid"].eq(1.0).all()
    e = curves[curves.arm == "edge"].iloc[0]
    assert e["valid"] == 0.5 and e["regret"] == pytest.approx((r_weak + WORLD.score_text("x", HARD, R, 4).regret) / 2)
    cf0 = curves[(curves.arm == "cf") & (curves.seed == 0)]
    assert steps_to_threshold(cf0, 0.01, smooth=1) == 2 and steps_to_threshold(cf0, 0.01, smooth=2) == 3
    assert steps_to_threshold(g[g.seed == 0], 0.01, smooth=1) is None
    exp = ExperimentConfig(arms=("cf", "global", "edge"), threshold=0.01, smooth=1, final_window=2)
    t = summary_table(curves, exp).set_index("arm")
    assert t.loc["cf", "final_regret"] == pytest.approx(0.0, abs=1e-12) and t.loc["cf", "reached"] == "3/3"
    assert t.loc["cf", "steps_to_threshold"] == pytest.approx(10 / 3) and t.loc["global", "reached"] == "0/3"
    lo, hi = t.loc["cf", "steps_ci"]
    assert 2 <= lo <= 10 / 3 <= hi <= 4
    b = band(curves, "regret")
    row = b[(b.arm == "cf") & (b.step == 3)].iloc[0]  # seed 0 at 0, seeds 1-2 at r_weak
    assert row["mean"] == pytest.approx(2 * r_weak / 3) and row["lo"] <= row["mean"] <= row["hi"] and row["seeds"] == 3
    assert bootstrap_ci([1.0, 1.0, 1.0]) == (1.0, 1.0) and all(math.isnan(x) for x in bootstrap_ci([]))
    # paired by seed: cf's final regret (last 2 steps) is 0 in every seed, global's r_weak / 2; edge has no seed 1-2
    # pair
    pt = paired_table(curves, None, exp).set_index(["arm", "metric"])
    row = pt.loc[("cf", "final_regret")]
    assert row["diff"] == pytest.approx(-r_weak / 2) and row["arm_better"] == "3/3" and row["seeds"] == 3
    assert pt.loc[("edge", "final_regret"), "seeds"] == 1 and ("cf", "heldout_regret") not in pt.index
    assert paired_table(curves[curves.arm != "global"], None, exp).empty
    comp = composition(collect(tmp_path, WORLD)).set_index(["arm", "phase"])
    best = WORLD.optimum(HARD, R, 4)
    assert comp.loc[("cf", "last 2 steps"), "agents"] == len(best.spec.agents)
    assert comp.loc[("cf", "last 2 steps"), "expected_reward"] == pytest.approx(best.expected_reward)
    assert comp.loc[("global", "first 2 steps"), "agents"] == pytest.approx((len(best.spec.agents) + 2) / 2)
    # one valid weak spec (2 agents, a medium solver read by a decider), one invalid
    e = comp.loc[("edge", "first 1 steps")]
    assert e["n"] == 2 and e["agents"] == 2 and e["final_large_solver"] == 0 and e["large_share"] == 0
    write_experiment(tmp_path, exp, WORLD, R, 4, ExecutorCaps(max_agents=4), "pytest tests/test_testbed.py")
    md = write_report(tmp_path, exp, WORLD).read_text()
    assert ("SIMULATED" in md and "| cf |" in md and "pytest tests/test_testbed.py" in md
            and "| cf | global | final_regret" in md)
    for png in ("curves.png", "summary.png"):
        assert (tmp_path / "plots" / png).stat().st_size > 10_000


def test_experiment_record_merges_invocations_of_one_config_and_refuses_another(tmp_path):
    """One folder filled arm by arm (experiments/testbed_chain.sh): experiment.json keeps one record whose arms and
    seeds are the union and whose commands are all kept, in order; a different budget in the same folder is refused by
    name."""
    caps = ExecutorCaps(max_agents=4)
    base = ExperimentConfig(world="two", arms=("cf", "global"), seeds=(0, 1), max_steps=3)
    write_experiment(tmp_path, base, WORLD, R, 4, caps, "cmd one")
    rec = write_experiment(tmp_path, ExperimentConfig(world="two", arms=("edge", "cf"), seeds=(2,), max_steps=3), WORLD,
                           R, 4, caps, "cmd two")
    assert rec["config"]["arms"] == ["cf", "global", "edge"] and rec["config"]["seeds"] == [0, 1, 2]
    assert rec["commands"] == ["cmd one", "cmd two"] and rec["command"] == "cmd two"
    assert json.loads((tmp_path / "experiment.json").read_text()) == rec
    with pytest.raises(ValueError, match=r"max_steps"):
        write_experiment(tmp_path, ExperimentConfig(world="two", arms=("role",), max_steps=4), WORLD, R, 4, caps,
                         "cmd three")
    assert json.loads((tmp_path / "experiment.json").read_text()) == rec  # the refused call wrote nothing


# ---- exact scoring (lemon.testbed.exact) -----------------------------------------------------------------------------
def test_exact_scorer_rewards_and_deltas_are_the_worlds_expected_values():
    """The trainer's scorer with exact scoring: every rollout's reward is the world's expected reward of its spec (no
    worker call), an invalid text gets r_invalid, and the counterfactual delta is the exact difference E[r(y)] -
    E[r(y')] of the very edit the scorer drew (re-drawn here with the scorer's per-rollout RNG)."""
    from lemon.spec import parse_spec
    from lemon.testbed.exact import ExactScorer, exact_scorer_factory
    from lemon.train.edits import FamilySampler, sample_edit
    from lemon.train.scoring import SpecScorer, edit_seed

    ex = TINY.examples()[0]
    caps = ExecutorCaps(max_agents=4, max_tokens={"small": 100, "medium": 160, "large": 240}, task_token_budget=5000)
    pool, calls = TINY.pool(), []
    pool.chat = lambda *a, **k: calls.append(a)  # the executor calls pool.chat: exact scoring must never get here
    scorer = exact_scorer_factory(TINY)(pool, P, {ex.id: ex}, {"gsm8k": GSM}, reward=R, caps=caps, cache=NodeCache(),
                                        sampler=FamilySampler(), cf_lambda=1.0, max_agents=4, seed=3)
    assert isinstance(scorer, ExactScorer) and isinstance(scorer, SpecScorer)
    specs = [spec(A("a1", cap="large"), A("a2", ["a1"], cap="large", base="verifier")),
             spec(A("a1", cap="medium"), A("a2", ["a1"], cap="small", base="critic"),
                  A("a3", ["a2", "a1"], base="decider")),
             spec(A("a1", cap="small", duty=P.default_duty("solver")))]
    texts = [s.to_yaml() for s in specs] + ["agents: [oops"]
    rolls = scorer.score([(ex.id, t, [ord(c) for c in t], 0, 0) for t in texts], step=1)  # char "tokens": exact decode
    for r, s in zip(rolls, specs):
        ev = TINY.evaluate(s, ex, R, caps)
        assert (r.valid and r.total == pytest.approx(ev.expected_reward)
                and r.reward.success == pytest.approx(ev.p_success))
        assert r.reward.worker_tokens == ev.tokens and r.tokens_spent == 0
    assert rolls[0].total > rolls[2].total > 0  # a large checked solver is worth more than a small base-duty one
    assert not rolls[3].valid and rolls[3].total == R.r_invalid
    probs = scorer.sampler.probs()
    scorer.add_counterfactuals(rolls, step=1, decode=lambda ids: "".join(map(chr, ids)))
    checked = 0
    for i, (r, t) in enumerate(zip(rolls[:3], texts)):
        parsed = parse_spec(t, base_roles=P.roles_for("math"), max_agents=4)
        edit = sample_edit(parsed, P, random.Random(edit_seed(3, 1, i)), probs)
        if edit is None:
            assert r.cf_status == "no_site"
            continue
        assert r.cf_status == "ok" and r.family == edit.family and r.span_positions
        assert r.delta == pytest.approx(r.total - TINY.expected_reward(edit.spec, ex, R, caps))
        checked += 1
    assert checked >= 2 and not calls
