"""The best spec of a simulated world (lemon.testbed.sim), by exhaustive search over the spec STRUCTURES that matter.

Free text never matters to the sim (only kind, capacity, customized-or-not and parents do), so a structure is a list of
`Node`s; `spec_of` turns one into a real Spec (representative base roles, duties customized or default) that the real
reward function reads. The search enumerates every structure left after these pruning arguments. Each argument replaces
a spec by one whose success probability is no lower and whose tokens, agents and edges are no higher, so it is exact
under three properties of the reward that `search` checks on the reward it is given (lemon.train.rewards; RewardConfig
checks the first):
  (R1) for fixed spec and tokens, a success scores at least a failure;  (R2) fewer worker tokens never score less;
  (R3) fewer agents / edges / unreachable agents never score less (graph cost is a cost).
The success probability of the final agent is non-decreasing in every solver's p and every checker's q (a W -> C switch
of any input can only raise a vote, and a checker keeps C), which is what makes the arguments below dominance arguments.
  P1  every agent reaches `final`, and `final` is the last agent: unreachable agents are never executed
      (lemon.run.executor), so they only add graph cost (R3).
  P2  one base role per kind (solver, verifier, decider, planner): roles of one kind are the same function in the sim.
  P3  solve and check agents have customized duties: the duty bonuses are >= 0 (SimConfig checks), success is monotone.
  P4  pass and note agents run at the cheapest capacity: their output does not depend on it; fewer tokens for them and
      for every agent that reads them (R2).
  P5  a solver reads nothing but (at most) one note: it ignores every other parent's answer; dropping such an edge
      changes no outcome and saves tokens and an edge (R2, R3). Notes have no parents (their output never depends on
      them), there is at most one note (one serves every solver), and none at all where plan_bonus = 0.
  P6  check / pass agents read at least one solver or check / pass agent and never a note (a note gives no answer, so it
      never enters a vote); without an answering parent they answer nothing, which the single-agent candidates cover.
  P7  order: the note first, then the solvers as a multiset, then the check / pass agents: any DAG obeying P5-P6 has
      this topological order, and reordering changes neither levels, tokens, outcomes nor graph cost.
tests/test_testbed.py checks the search against brute force over all structures (no pruning) for max_agents <= 3.
"""
from __future__ import annotations

from itertools import combinations, combinations_with_replacement, product
from typing import Callable, Iterator

from lemon.prompts import CAPACITIES, Prompts
from lemon.spec import Agent, Spec
from lemon.testbed.sim import Node, SimConfig, TaskType

ROLE_OF = {"solve": "solver", "check": "verifier", "pass": "decider", "note": "planner"}  # P2: one role per kind
CUSTOM_DUTY = {"solve": "Work out every quantity of this task step by step and compute the final number.",
               "check": "Re-solve this task independently and correct the previous answer if it is wrong.",
               "pass": "Give the single final answer of the team, trusting the most careful previous work.",
               "note": "List the sub-steps needed to solve this task, without solving it."}


def spec_of(nodes: list[Node], prompts: Prompts, config: SimConfig | None = None) -> Spec:
    """A real Spec with this structure: ids a1..an, final = the last agent (no text; parse its to_yaml() for one). A
    node's duty effect picks its duty: the default (0), a customized duty naming the first of `config`'s words for its
    kind (+1), or one naming none of them (-1)."""
    agents = []
    for i, n in enumerate(nodes):
        role = ROLE_OF.get(n.kind)
        if role is None:
            raise ValueError(f"no representative base role for kind {n.kind!r}")
        words = (config.duty_words.get(n.kind) if config is not None else None) or ()
        duty = prompts.default_duty(role) if not n.custom else CUSTOM_DUTY[n.kind]
        if n.custom and words and n.custom > 0 and not any(w in duty.lower() for w in words):
            duty = f"{words[0].capitalize()} - {duty}"
        elif n.custom and n.custom < 0:
            if config is not None and any(w in OFF_DUTY.lower() for ws in config.duty_words.values() for w in ws):
                raise ValueError(f"OFF_DUTY {OFF_DUTY!r} names a word this world rewards: a -1 node cannot be written")
            duty = OFF_DUTY
        agents.append(Agent(f"a{i + 1}", role, f"{role.title()} {i + 1}", duty, n.cap,
                            tuple(f"a{j + 1}" for j in n.deps)))
    return Spec(tuple(agents), agents[-1].id)


# a customized duty that names nothing a world rewards (spec_of checks it holds no word of the world's lists)
OFF_DUTY = "Be brief."


def _reaches_final(nodes: list[Node]) -> bool:
    reach = {len(nodes) - 1}
    for i in range(len(nodes) - 1, -1, -1):
        if i in reach:
            reach.update(nodes[i].deps)
    return len(reach) == len(nodes)


def _nonempty_subsets(items: list[int]) -> list[tuple[int, ...]]:
    return [c for r in range(1, len(items) + 1) for c in combinations(items, r)]


def structures(ttype: TaskType, cfg: SimConfig, max_agents: int) -> Iterator[list[Node]]:
    """Every structure left by P1-P7 with 1..max_agents agents."""
    cheap = min(CAPACITIES, key=lambda c: (cfg.completion_tokens[c], CAPACITIES.index(c)))
    for c in CAPACITIES:
        yield [Node("solve", c, True)]
    yield [Node("note", cheap, True)]  # answers nothing: the best spec when nothing can succeed (any lone non-solver)
    aggs = [Node("check", c, True) for c in CAPACITIES] + [Node("pass", cheap, True)]
    for n in range(2, max_agents + 1):
        for has_note in ((False, True) if ttype.plan_bonus > 0 else (False,)):
            for k in range(1, n - has_note + 1):
                m = n - has_note - k
                if m == 0 and k > 1:
                    continue  # only the last of several solvers would reach final (P1)
                variants = [(c, r) for c in CAPACITIES for r in ((False, True) if has_note else (False,))]
                for combo in combinations_with_replacement(variants, k):
                    if has_note and not any(r for _, r in combo):
                        continue  # the note would be unreachable (P1)
                    head = [Node("note", cheap, True)] if has_note else []
                    head += [Node("solve", c, True, (0,) if r else ()) for c, r in combo]
                    if m == 0:
                        yield head
                        continue
                    first = int(has_note)
                    choices = [_nonempty_subsets(list(range(first, len(head) + i))) for i in range(m)]
                    for kinds in product(aggs, repeat=m):
                        for deps in product(*choices):
                            nodes = head + [a._replace(deps=d) for a, d in zip(kinds, deps)]
                            if _reaches_final(nodes):
                                yield nodes


def check_reward_properties(reward: Callable[[Spec, float, int], float], prompts: Prompts) -> None:
    """Spot-check R1-R3 on small specs; raise ValueError naming the property the search would silently rely on."""
    one, two = spec_of([Node("solve", "large", True)], prompts), \
        spec_of([Node("solve", "large", True), Node("check", "large", True, (0,))], prompts)
    for s in (one, two):
        for t in (0, 500, 5000):
            if reward(s, 1.0, t) < reward(s, 0.0, t):
                raise ValueError("the reward scores a failure above a success (R1): the testbed's optimum "
                                 "search needs R1")
            for sc in (0.0, 1.0):
                if reward(s, sc, t) < reward(s, sc, t + 100):
                    raise ValueError("the reward grows with worker tokens (R2): the optimum search's pruning needs R2")
    for sc, t in ((0.0, 300), (1.0, 300)):
        if reward(one, sc, t) < reward(two, sc, t):
            raise ValueError("the reward grows with agents / edges (R3): the optimum search's pruning needs R3")


def search(value: Callable[[list[Node]], float], ttype: TaskType, cfg: SimConfig,
           max_agents: int) -> tuple[list[Node], float, int]:
    """(best structure, its value, structures evaluated). Ties go to the first found (fewer agents first)."""
    best, best_v, count = None, float("-inf"), 0
    for nodes in structures(ttype, cfg, max_agents):
        v = value(nodes)
        count += 1
        if v > best_v + 1e-12:
            best, best_v = nodes, v
    return best, best_v, count
