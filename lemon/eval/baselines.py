"""The paper's baselines, expressed as specs so that one executor runs (and meters) everything.

Single agent: `vanilla` (answer directly), `cot` (think step by step), `sc-cot` (k CoT samples with different seeds at a
sampling temperature, majority vote over the extracted answers; Wang et al., 2023). Fixed multi-agent topologies, as in
the paper's multi-agent baselines (the AgentPrune / G-Designer family): `chain`, `tree`, `complete`, `random`, each
ending in a final decision agent. `n_agents` counts every agent *including* the final one, so a baseline with n agents
costs about what a LEMON spec with n agents costs, and `complete` has exactly n(n-1)/2 edges. Base roles come from the
domain's part of the prompts file; every agent uses its base role's default duty (a fixed system has no task-specific
duties: that is what LEMON adds, paper §3.1).
"""
from __future__ import annotations

import random
import time
from collections import Counter

from lemon.run.executor import ExecutorCaps, NodeCache, Trace, execute
from lemon.prompts import Prompts, default_prompts
from lemon.spec import MAX_AGENTS, Spec, spec_from_dict

BASELINES = ("vanilla", "cot", "sc-cot", "chain", "tree", "complete", "random")
MULTI_AGENT = ("chain", "tree", "complete", "random")

# Domain -> worker base roles, cycled over the non-final agents (first = the domain's solver, so a 2-agent system
# solves).
WORKER_ROLES = {"math": ("solver", "verifier", "calculator"), "knowledge": ("expert", "eliminator", "recaller"),
                "code": ("coder", "reviewer", "tester")}
SOLVER = {d: r[0] for d, r in WORKER_ROLES.items()}
# The final decision agent: `decider` reads everything and answers; for code the answer must be a complete function, so
# the domain's coder decides (a decider would tend to describe rather than write the code).
DECIDER = {"math": "decider", "knowledge": "decider", "code": "coder"}
AGGREGATOR = {"math": "summarizer", "knowledge": "summarizer", "code": "reviewer"}  # the tree's middle level
DIRECT_DUTY = {"math": "Give the final answer directly, without showing your work.",
               "knowledge": "Give the correct option directly, without explanation.",
               "code": "Write the function directly, without explanation."}
COT_DUTY = {"math": "Think step by step: write out each reasoning step and calculation, then give the final answer.",
            "knowledge": "Think step by step about what each option claims and which fact decides it, then answer.",
            "code": "Think step by step about the algorithm and the edge cases, then write the function."}
FINAL_CODE_DUTY = "Read the previous agents' code and reviews and write the single best complete implementation."
SC_COT_TEMPERATURE = 0.7  # sampling temperature of SC-CoT's samples (greedy samples would all be identical)


class UnknownMethodError(ValueError):
    """A baseline name that is not in BASELINES."""


def _check(name: str, domain: str, n_agents: int, prompts: Prompts) -> None:
    if name not in BASELINES:
        raise UnknownMethodError(f"unknown baseline {name!r}; valid: {', '.join(BASELINES)}")
    roles = prompts.roles_for(domain)  # raises ValueError for an unknown domain
    need = {*WORKER_ROLES[domain], DECIDER[domain], AGGREGATOR[domain]}
    if need - set(roles):
        raise ValueError(f"prompts file {prompts.path} lacks base roles {sorted(need - set(roles))} for "
                         f"domain {domain!r}")
    lo = 3 if name == "tree" else 2
    if name in MULTI_AGENT and not lo <= n_agents <= MAX_AGENTS:
        raise ValueError(f"{name} needs n_agents in {lo}..{MAX_AGENTS} (the final agent included), got {n_agents}")


def _agent(aid: str, base_role: str, role: str, duty: str, capacity: str, deps=()) -> dict:
    return {"id": aid, "base_role": base_role, "role": role, "duty": duty, "capacity": capacity,
            "depends_on": list(deps)}


def _edges(name: str, n: int, seed: int, draw: str = "") -> list[list[int]]:
    """parents[i] for agents 0..n-1 (agent n-1 is the final one); every edge points from an earlier to a later agent.
    `draw` keys the random DAG (run_baseline passes the example id, so Random is a fresh seeded DAG per question)."""
    if name == "chain":
        return [[]] + [[i - 1] for i in range(1, n)]
    if name == "complete":
        return [list(range(i)) for i in range(n)]
    if name == "tree":
        # n-1 workers: leaves work independently, about a third aggregate (leaves dealt round-robin), one decider reads
        # them.
        n_agg = max(1, (n - 1) // 3)
        n_leaf = n - 1 - n_agg
        parents = [[] for _ in range(n_leaf)]
        parents += [[j for j in range(n_leaf) if j % n_agg == g] for g in range(n_agg)]
        return parents + [list(range(n_leaf, n - 1))]
    # random: each earlier->later edge with p=1/2, then every agent without a child gets one later child, so every
    # agent reaches the final one (induction from the back: agent n-2 can only point at n-1).
    rng = random.Random(f"lemon-random-dag/{seed}/{n}/{draw}")
    parents = [[j for j in range(i) if rng.random() < 0.5] for i in range(n)]
    for j in range(n - 1):
        if not any(j in parents[i] for i in range(j + 1, n)):
            parents[rng.randrange(j + 1, n)].append(j)
    return [sorted(p) for p in parents]


def baseline_spec(name: str, domain: str, *, capacity: str = "medium", n_agents: int = 4, seed: int = 0,
                  prompts: Prompts | None = None, draw: str = "") -> Spec:
    """The spec of a baseline (for sc-cot: the single CoT spec that run_baseline samples k times). Validated by
    parse_spec. `draw` only matters for `random`: it keys the DAG together with `seed` (see _edges)."""
    prompts = prompts or default_prompts()
    _check(name, domain, n_agents, prompts)
    duty = prompts.default_duty
    if name in ("vanilla", "cot", "sc-cot"):
        d = DIRECT_DUTY[domain] if name == "vanilla" else COT_DUTY[domain]
        role = "Direct solver" if name == "vanilla" else "Step-by-step solver"
        agents = [_agent("solve", SOLVER[domain], role, d, capacity)]
    else:
        parents = _edges(name, n_agents, seed, draw)
        workers = WORKER_ROLES[domain]
        agg = set(range(n_agents - 1 - max(1, (n_agents - 1) // 3), n_agents - 1)) if name == "tree" else set()
        agents = []
        for i in range(n_agents - 1):
            base = AGGREGATOR[domain] if i in agg else SOLVER[domain] if name == "tree" else workers[i % len(workers)]
            agents.append(_agent(f"a{i + 1}", base, f"{base.title()} {i + 1}", duty(base), capacity,
                                 [f"a{j + 1}" for j in parents[i]]))
        fbase = DECIDER[domain]
        fduty = FINAL_CODE_DUTY if domain == "code" else duty(fbase)
        agents.append(_agent("final", fbase, "Final decider", fduty, capacity, [f"a{j + 1}" for j in parents[-1]]))
    return spec_from_dict({"agents": agents, "final": agents[-1]["id"]}, base_roles=prompts.roles_for(domain))


def majority_vote(answers: list[str | None]) -> int | None:
    """Index of the representative sample: the earliest sample whose answer is a mode of the non-None answers (so ties
    go to the earliest sample). For HumanEval the answers are code strings, rarely equal: the vote then degrades to the
    first sample with extractable code, which is the documented behaviour. None when no sample has an answer."""
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return None
    top = max(counts.values())
    return next(i for i, a in enumerate(answers) if a is not None and counts[a] == top)


def example_spec(name: str, example, domain: str, *, prompts: Prompts, capacity: str = "medium", n_agents: int = 4,
                 seed: int = 0) -> Spec:
    """The spec a baseline runs on one example. Only Random depends on the example: its DAG is keyed by (seed, example
    id), so reruns and resumes redraw the same DAG. One fixed Random DAG per run would be one more fixed topology (with
    3 agents, seed 0 drew exactly Complete's DAG in outputs/reference/cpu-20261130); a DAG per question makes it a
    random-topology baseline."""
    return baseline_spec(name, domain, capacity=capacity, n_agents=n_agents, seed=seed, prompts=prompts,
                         draw=str(example.id) if name == "random" else "")


def run_baseline(name: str, example, benchmark, pool, *, prompts: Prompts, capacity: str = "medium", n_agents: int = 4,
                 k: int = 5, seed: int = 0, cache: NodeCache | None = None, caps: ExecutorCaps | None = None,
                 meter=None, temperature: float = SC_COT_TEMPERATURE) -> Trace:
    """Run one baseline on one example. sc-cot runs the CoT spec k times (seeds seed..seed+k-1, at `temperature`) and
    returns one Trace: all samples' agents (ids prefixed s<i>/), summed tokens and latency, answer = majority vote,
    score = the score of the representative sample (the earliest with the voted answer). Any sample's error is reported,
    and scores the vote 0."""
    caps = caps or ExecutorCaps()
    spec = example_spec(name, example, benchmark.domain, prompts=prompts, capacity=capacity, n_agents=n_agents,
                        seed=seed)
    if name != "sc-cot":
        return execute(spec, example, benchmark, pool, prompts=prompts, cache=cache, caps=caps, seed=seed, meter=meter)
    if k < 1:
        raise ValueError(f"sc-cot needs k >= 1 samples, got {k}")
    t0 = time.perf_counter()
    samples = [execute(spec, example, benchmark, pool, prompts=prompts, cache=cache, caps=caps, seed=seed + i,
                       meter=meter, sampling={"temperature": temperature}) for i in range(k)]
    agents = []
    for i, s in enumerate(samples):
        for a in s.agents:
            a.id = f"s{i}/{a.id}"
            agents.append(a)
    errors = [f"sample {i}: {s.error}" for i, s in enumerate(samples) if s.error]
    rep = majority_vote([s.answer for s in samples])
    out = Trace(agents=agents, tokens=sum(s.tokens for s in samples),
                nominal_tokens=sum(s.nominal_tokens for s in samples),
                worker_latency_s=sum(s.worker_latency_s for s in samples),
                budget_exceeded=all(s.budget_exceeded for s in samples), error="; ".join(errors) or None)
    if rep is not None and not errors:
        out.output, out.answer, out.score = samples[rep].output, samples[rep].answer, samples[rep].score
    out.wall_s = time.perf_counter() - t0
    return out
