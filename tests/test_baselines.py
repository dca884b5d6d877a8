"""Baselines: valid specs with the expected shapes for every domain, and run_baseline (incl. the SC-CoT vote) on a fake
pool."""
import itertools

import pytest

from lemon.eval.baselines import BASELINES, UnknownMethodError, baseline_spec, majority_vote, run_baseline
from lemon.benchmarks import Example, get_benchmark
from lemon.run.executor import NodeCache
from lemon.prompts import DOMAINS, default_prompts
from lemon.spec import parse_spec
from lemon.run.workers import FakeBackend, SamplingParams, WorkerPool

P = default_prompts()
GSM = get_benchmark("gsm8k")
EX = Example("t/0", "gsm8k", "test", "Tom has 3 apples and buys 4 more. How many apples?", "7")


def pool_of(fake):
    return WorkerPool({c: fake for c in ("small", "medium", "large")},
                      {c: SamplingParams(max_tokens=64) for c in ("small", "medium", "large")})


@pytest.mark.parametrize("name,domain", list(itertools.product(BASELINES, DOMAINS)))
def test_every_baseline_is_a_valid_spec(name, domain):
    for n in ((3, 4, 8) if name in ("chain", "tree", "complete", "random") else (4,)):
        s = baseline_spec(name, domain, capacity="large", n_agents=n, seed=1)
        assert parse_spec(s.to_yaml(), base_roles=P.roles_for(domain)) == s
        assert all(a.capacity == "large" for a in s.agents) and s.final == s.agents[-1].id
        assert not s.unreachable()
        assert len(s.agents) == (1 if name in ("vanilla", "cot", "sc-cot") else n)


def test_shapes():
    ids = lambda s: [a.id for a in s.agents]  # noqa: E731
    s = baseline_spec("chain", "math", n_agents=4)
    assert s.edges() == [("a1", "a2"), ("a2", "a3"), ("a3", "final")] and len(s.levels()) == 4
    for n in range(2, 9):
        assert len(baseline_spec("complete", "knowledge", n_agents=n).edges()) == n * (n - 1) // 2
    t = baseline_spec("tree", "code", n_agents=7)  # 4 leaves, 2 aggregators, 1 decider
    assert [len(lvl) for lvl in t.levels()] == [4, 2, 1]
    assert {a.base_role for a in t.agents} == {"coder", "reviewer"}
    assert sorted(t.agent("final").depends_on) == ["a5", "a6"]
    assert baseline_spec("tree", "math", n_agents=4).levels() == [["a1", "a2"], ["a3"], ["final"]]
    assert baseline_spec("chain", "math").agent("final").base_role == "decider"
    assert baseline_spec("chain", "code").agent("final").base_role == "coder"
    assert ids(baseline_spec("vanilla", "math")) == ["solve"]
    assert baseline_spec("cot", "math") == baseline_spec("sc-cot", "math")
    assert "step by step" in baseline_spec("cot", "knowledge").agents[0].duty


def test_random_is_seeded_and_connected():
    for n in range(2, 9):
        specs = [baseline_spec("random", "math", n_agents=n, seed=sd) for sd in range(12)]
        assert specs[3] == baseline_spec("random", "math", n_agents=n, seed=3)  # deterministic
        for s in specs:
            assert not s.unreachable() and s.agent("final").depends_on
            assert all(s.index(p) < s.index(c) for p, c in s.edges())
        if n >= 3:
            assert len({tuple(s.edges()) for s in specs}) > 1  # the seed matters
    # run_baseline draws one DAG per question (keyed by the example id): same id -> same DAG, ids vary the DAG
    per_q = [baseline_spec("random", "math", n_agents=3, seed=0, draw=f"gsm8k/test/{i}") for i in range(12)]
    assert per_q[5] == baseline_spec("random", "math", n_agents=3, seed=0, draw="gsm8k/test/5")
    assert len({tuple(s.edges()) for s in per_q}) > 1
    assert any(tuple(s.edges()) != tuple(baseline_spec("complete", "math", n_agents=3).edges()) for s in per_q)


def test_errors():
    with pytest.raises(UnknownMethodError, match="vanilla, cot, sc-cot"):
        baseline_spec("debate", "math")
    assert issubclass(UnknownMethodError, ValueError)
    with pytest.raises(UnknownMethodError):
        run_baseline("nope", EX, GSM, pool_of(FakeBackend()), prompts=P)
    with pytest.raises(ValueError, match="n_agents"):
        baseline_spec("tree", "math", n_agents=2)
    with pytest.raises(ValueError, match="n_agents"):
        baseline_spec("chain", "math", n_agents=9)
    with pytest.raises(ValueError, match="domain"):
        baseline_spec("cot", "poetry")


@pytest.mark.parametrize("name", BASELINES)
def test_run_baseline_on_fake_pool(name):
    fake = FakeBackend("Answer: 7")
    tr = run_baseline(name, EX, GSM, pool_of(fake), prompts=P, capacity="small", n_agents=3, k=3)
    assert tr.error is None and tr.answer == "7" and tr.score == 1.0 and tr.tokens > 0
    expected = 3 if name in ("sc-cot", "chain", "tree", "complete", "random") else 1
    assert len(fake.calls) == expected == len(tr.agents)


def test_majority_vote():
    assert majority_vote(["5", "7", "7", "5", "7"]) == 1
    assert majority_vote(["5", "7"]) == 0  # tie -> earliest
    assert majority_vote([None, "7", "5", "5"]) == 2
    assert majority_vote([None, None]) is None


def test_sc_cot_votes_over_seeded_samples():
    replies = iter(["Answer: 5", "Answer: 7", "no idea", "Answer: 7", "Answer: 3"])
    fake = FakeBackend(lambda m, p: next(replies))
    cache = NodeCache()
    tr = run_baseline("sc-cot", EX, GSM, pool_of(fake), prompts=P, k=5, seed=10, cache=cache)
    assert tr.answer == "7" and tr.score == 1.0 and tr.output == "Answer: 7"
    assert len({c.params.seed for c in fake.calls}) == 5 and all(c.params.temperature == 0.7 for c in fake.calls)
    assert [a.id for a in tr.agents] == [f"s{i}/solve" for i in range(5)]
    assert tr.tokens == tr.nominal_tokens == sum(a.prompt_tokens + a.completion_tokens for a in tr.agents)
    again = run_baseline("sc-cot", EX, GSM, pool_of(fake), prompts=P, k=5, seed=10, cache=cache)
    assert again.tokens == 0 and again.answer == "7" and again.nominal_tokens == tr.nominal_tokens


def test_sc_cot_sample_error_is_reported():
    replies = iter(["Answer: 7", None, "Answer: 7"])

    def reply(m, p):
        r = next(replies)
        if r is None:
            raise RuntimeError("flaky")
        return r
    tr = run_baseline("sc-cot", EX, GSM, pool_of(FakeBackend(reply)), prompts=P, k=3)
    assert "sample 1" in tr.error and "flaky" in tr.error and tr.score == 0.0
