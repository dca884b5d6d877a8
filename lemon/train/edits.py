"""Counterfactual edits of a spec (paper §3.3) and the adaptive family sampler.

Three families, each changing exactly ONE field value of one agent:
  m_E "edge":     drop one dependency edge (child no longer reads parent);
  m_R "role":     roll one agent's customized duty back to its base role's default duty (from the prompts file);
  m_L "capacity": lower one agent's capacity one level (large -> medium -> small).
An edit is made on the TEXT the model wrote (only the edited value's characters change), so every other agent is byte-identical
and the node cache reuses it; the edited text is re-parsed to prove it is a valid spec. Each Edit carries the character span of
the edited value in the ORIGINAL text: the counterfactual loss puts the reward contrast on exactly those tokens.
A site whose edit would change nothing is never eligible: duty already the default, capacity already small, and any agent that
cannot reach `final` (it is not executed, so editing it is a no-op).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

from lemon.prompts import CAPACITIES, Prompts
from lemon.spec import Span, Spec, parse_spec

FAMILIES = ("edge", "role", "capacity")  # m_E, m_R, m_L


@dataclass(frozen=True)
class Edit:
    family: str
    site: tuple[str, ...]  # (child, parent) for edge; (agent,) for role / capacity
    span: Span  # the edited value's [start, end) in the ORIGINAL spec text (where the contrast is applied)
    replaced: Span  # the region of the original text that was rewritten (contains span; wider for edge: the whole list)
    text: str  # the edited spec text
    spec: Spec  # the edited spec, parsed from `text`


def eligible_sites(spec: Spec, family: str, prompts: Prompts) -> list[tuple[str, ...]]:
    """Sites where `family` changes what is executed."""
    if family not in FAMILIES:
        raise ValueError(f"unknown edit family {family!r}; valid: {', '.join(FAMILIES)}")
    dead = set(spec.unreachable())
    live = [a for a in spec.agents if a.id not in dead]
    if family == "edge":
        return [(a.id, d) for a in live for d in a.depends_on]
    if family == "role":
        return [(a.id,) for a in live if a.duty != prompts.default_duty(a.base_role)]
    return [(a.id,) for a in live if a.capacity != CAPACITIES[0]]


def apply_edit(spec: Spec, family: str, site: tuple[str, ...], prompts: Prompts) -> Edit:
    """Apply one edit to a parsed spec (which must carry its text and spans)."""
    if spec.text is None or spec.spans is None:
        raise ValueError("apply_edit needs a spec parsed from text (it edits the text and reports spans in it)")
    if site not in eligible_sites(spec, family, prompts):
        raise ValueError(f"site {site} is not eligible for {family!r} in this spec")
    i = spec.index(site[0])
    a, sp = spec.agents[i], spec.spans[i]
    if family == "role":
        span, new = sp.duty, json.dumps(prompts.default_duty(a.base_role), ensure_ascii=False)
        replace_span = span
    elif family == "capacity":
        span, new = sp.capacity, CAPACITIES[CAPACITIES.index(a.capacity) - 1]
        replace_span = span
    else:
        j = a.depends_on.index(site[1])
        span = sp.deps[j]  # the contrast lands on the dropped parent's id token(s)
        rest = [d for d in a.depends_on if d != site[1]]
        new = "[" + ", ".join(json.dumps(d) for d in rest) + "]"
        replace_span = sp.depends_on  # rewrite the whole list (block or flow) as a flow list
    t = spec.text
    text = t[:replace_span[0]] + new + t[replace_span[1]:]
    edited = parse_spec(text, base_roles=prompts.roles_for(None), max_agents=max(len(spec.agents), 1))
    return Edit(family, site, span, replace_span, text, edited)


def sample_edit(spec: Spec, prompts: Prompts, rng: random.Random, family_probs: dict[str, float] | None = None) -> Edit | None:
    """Choose a family (from `family_probs`, renormalised over families that have an eligible site), then a site uniformly.
    None when the spec has no eligible site in any family (that rollout gets no counterfactual term)."""
    sites = {f: eligible_sites(spec, f, prompts) for f in FAMILIES}
    fams = [f for f in FAMILIES if sites[f]]
    if not fams:
        return None
    probs = family_probs or {f: 1.0 for f in FAMILIES}
    weights = [probs[f] for f in fams]
    f = rng.choices(fams, weights=weights)[0] if sum(weights) > 0 else rng.choice(fams)
    return apply_edit(spec, f, rng.choice(sites[f]), prompts)


@dataclass
class FamilySampler:
    """Adaptive family choice: p(f) = floor + (1 - K*floor) * m_f / sum(m), with m_f the running mean of |delta| over the
    last `window` edits of family f (a family not yet tried gets `init`). The floor keeps every family explored even when its
    recent contrasts were zero. State round-trips through state_dict() for checkpoints."""

    floor: float = 0.1
    window: int = 50
    init: float = 1.0
    history: dict[str, list[float]] = field(default_factory=lambda: {f: [] for f in FAMILIES})

    def __post_init__(self):
        if not 0 <= self.floor <= 1 / len(FAMILIES):
            raise ValueError(f"floor={self.floor} must be in [0, 1/{len(FAMILIES)}] so the probabilities can sum to 1")
        if self.window < 1:
            raise ValueError("window must be >= 1")

    def means(self) -> dict[str, float]:
        return {f: (sum(h) / len(h) if h else self.init) for f, h in self.history.items()}

    def probs(self) -> dict[str, float]:
        m = self.means()
        total = sum(m.values())
        k = len(FAMILIES)
        if total <= 0:
            return {f: 1 / k for f in FAMILIES}
        return {f: self.floor + (1 - k * self.floor) * m[f] / total for f in FAMILIES}

    def update(self, family: str, delta: float) -> None:
        h = self.history[family]
        h.append(abs(float(delta)))
        del h[:-self.window]

    def state_dict(self) -> dict:
        return {"floor": self.floor, "window": self.window, "init": self.init,
                "history": {f: list(h) for f, h in self.history.items()}}

    @classmethod
    def from_state(cls, state: dict) -> "FamilySampler":
        return cls(state["floor"], state["window"], state["init"], {f: list(h) for f, h in state["history"].items()})
