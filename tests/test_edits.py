"""Counterfactual edits: one field changes, spans point into the original text, no-op sites are never eligible."""
import random

import pytest

from lemon.train.edits import FAMILIES, FamilySampler, apply_edit, eligible_sites, sample_edit
from lemon.prompts import default_prompts
from lemon.spec import parse_spec

P = default_prompts()
BLOCK = """Here you go:
```yaml
agents:
  - id: plan
    base_role: planner
    role: Planner
    duty: Break the task into a short numbered plan of sub-steps. Do not solve it.
    capacity: small
  - id: solve
    base_role: solver
    role: 'Solver'
    duty: |
      Follow the plan and compute
      the answer.
    capacity: "large"
    depends_on:
      - plan
  - id: idle
    base_role: critic
    role: Idle
    duty: Says things.
    capacity: medium
    depends_on: [plan]
  - id: check
    base_role: verifier
    role: Checker
    duty: Check it.
    capacity: medium
    depends_on: [plan, solve]
final: check
```"""
FLOW = ('{"agents": [{"id": "a", "base_role": "solver", "role": "A", "duty": "Do A.", "capacity": "large", "depends_on": []},'
        ' {"id": "b", "base_role": "decider", "role": "B", "duty": "Do B.", "capacity": "medium", "depends_on": ["a"]}]}')


def test_eligibility_excludes_noops_and_dead_agents():
    s = parse_spec(BLOCK)
    assert s.unreachable() == ["idle"]
    # plan's duty IS the planner default -> not eligible; idle is unreachable -> nothing of it is eligible
    assert eligible_sites(s, "role", P) == [("solve",), ("check",)]
    assert eligible_sites(s, "capacity", P) == [("solve",), ("check",)]  # plan is already small
    assert eligible_sites(s, "edge", P) == [("solve", "plan"), ("check", "plan"), ("check", "solve")]
    with pytest.raises(ValueError, match="valid: edge, role, capacity"):
        eligible_sites(s, "colour", P)


@pytest.mark.parametrize("text", [BLOCK, FLOW])
def test_every_edit_changes_exactly_one_field(text):
    s = parse_spec(text)
    n = 0
    for fam in FAMILIES:
        for site in eligible_sites(s, fam, P):
            e = apply_edit(s, fam, site, P)
            n += 1
            assert e.spec != s
            changed = [(a.id, f) for a, b in zip(s.agents, e.spec.agents)
                       for f in ("base_role", "role", "duty", "capacity", "depends_on") if getattr(a, f) != getattr(b, f)]
            field = {"edge": "depends_on", "role": "duty", "capacity": "capacity"}[fam]
            assert changed == [(site[0], field)]
            a, b = s.agent(site[0]), e.spec.agent(site[0])
            frag = text[e.span[0]:e.span[1]]
            if fam == "capacity":
                assert frag.strip("'\"") == a.capacity and b.capacity == {"large": "medium", "medium": "small"}[a.capacity]
            elif fam == "role":
                assert b.duty == P.default_duty(a.base_role)
                assert a.duty.split()[0] in frag
            else:
                assert frag.strip("'\"") == site[1] and site[1] not in b.depends_on
            # text outside the replaced region is untouched, so unchanged agents are byte-identical for the cache
            assert e.replaced[0] <= e.span[0] <= e.span[1] <= e.replaced[1]
            assert e.text.startswith(text[:e.replaced[0]]) and e.text.endswith(text[e.replaced[1]:])
    assert n > 0


def test_ineligible_site_and_unparsed_spec_refused():
    s = parse_spec(BLOCK)
    with pytest.raises(ValueError, match="not eligible"):
        apply_edit(s, "capacity", ("plan",), P)
    from lemon.spec import Spec
    with pytest.raises(ValueError, match="parsed from text"):
        apply_edit(Spec(s.agents, s.final), "capacity", ("solve",), P)


def test_sample_edit_none_when_nothing_eligible():
    s = parse_spec('agents:\n  - {id: a, base_role: solver, role: A, '
                   'duty: "Solve the problem step by step and state the final numeric result.", capacity: small}\n')
    assert sample_edit(s, P, random.Random(0)) is None


def test_sample_edit_follows_family_probs():
    s = parse_spec(BLOCK)
    rng = random.Random(0)
    fams = [sample_edit(s, P, rng, {"edge": 0.0, "role": 1.0, "capacity": 0.0}).family for _ in range(20)]
    assert set(fams) == {"role"}


def test_sampler_floor_and_proportionality():
    fs = FamilySampler(floor=0.1, window=3)
    assert fs.probs() == pytest.approx({f: 1 / 3 for f in FAMILIES})
    for d in (0.0, 0.0, 0.0):
        fs.update("edge", d)
    for d in (1.0, -1.0, 1.0):  # |delta| is what counts
        fs.update("role", d)
    for d in (0.5, 0.5, -0.5):
        fs.update("capacity", d)
    p = fs.probs()
    assert p["edge"] == pytest.approx(0.1)  # floor respected though its mean |delta| is 0
    assert p["role"] == pytest.approx(0.1 + 0.7 * 1.0 / 1.5)
    assert p["capacity"] == pytest.approx(0.1 + 0.7 * 0.5 / 1.5)
    assert sum(p.values()) == pytest.approx(1.0)
    fs.update("edge", 3.0)  # window 3: the oldest zero drops out
    assert fs.means()["edge"] == pytest.approx(1.0)
    again = FamilySampler.from_state(fs.state_dict())
    assert again.probs() == fs.probs()
    with pytest.raises(ValueError, match="floor"):
        FamilySampler(floor=0.5)
