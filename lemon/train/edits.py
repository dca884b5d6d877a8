"""Counterfactual edits of a spec (paper §3.3) and the adaptive family sampler.

Three families (REGISTRY below: one EditFamily record each), each changing exactly ONE field value of one agent:
  m_E "edge":     drop one dependency edge (child no longer reads parent);
  m_R "role":     roll one agent's customized duty back to its base role's default duty (from the prompts file);
  m_L "capacity": lower one agent's capacity one level (large -> medium -> small).
An edit is made on the TEXT the model wrote (only the edited value's characters change), so every other agent is
byte-identical and the node cache reuses it. The rewrite never depends on the YAML style the model chose: a duty becomes
one double-quoted scalar (valid wherever a block, folded, plain or quoted scalar stood), a capacity keeps its quoting,
and a dependency list is rewritten from just after its key's `:` as a flow list (valid after a block, indentless-block
or flow list alike, and inside a flow mapping / JSON). The edited text is re-parsed AND compared with the expected spec
(the original with exactly that one change); an edit that fails either check raises EditError, so a caller never trains
on a wrong counterfactual. Each Edit carries the character span of the edited value in the ORIGINAL text: the
counterfactual loss puts the reward contrast on exactly those tokens (lemon.train.spanmap maps it onto the sampled ids).
A site whose edit would change nothing is never eligible: duty already the default, capacity already small, and any
agent that cannot reach `final` (it is not executed, so editing it is a no-op).
"""
from __future__ import annotations

import dataclasses
import json
import random
import re
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import yaml

from lemon.prompts import CAPACITIES, Prompts
from lemon.spec import Span, Spec, SpecError, extract_yaml, parse_spec



class EditError(ValueError):
    """An edit that cannot be applied: the site is not eligible, the spec carries no text, or the rewritten text is not
    the original spec with exactly the family's one change. The trainer counts these (cf/edit_errors) and skips the CF
    term."""


@dataclass(frozen=True)
class Edit:
    family: str
    site: tuple[str, ...]  # (child, parent) for edge; (agent,) for role / capacity
    span: Span  # the edited value's [start, end) in the ORIGINAL spec text (where the contrast is applied)
    replaced: Span  # the region of the original text that was rewritten (contains span; wider for edge: the whole list)
    text: str  # the edited spec text
    spec: Spec  # the edited spec, parsed from `text`


def eligible_sites(spec: Spec, family: str, prompts: Prompts) -> list[tuple[str, ...]]:
    """Sites where `family` changes what is executed. ValueError for an unknown family; EditError when the family cannot
    read the spec (m_R: a base role with no default duty in `prompts`)."""
    if family not in REGISTRY:
        raise ValueError(f"unknown edit family {family!r}; valid: {', '.join(REGISTRY)}")
    dead = set(spec.unreachable())
    return REGISTRY[family].sites(spec, [a for a in spec.agents if a.id not in dead], prompts)

# YAML reads these inside a double-quoted scalar as line breaks (folded) or refuses them outright; JSON leaves them raw
_YAML_UNSAFE = re.compile("[^\x09\x0A\x0D\x20-\x7E\xA0-\uD7FF\uE000-\uFFFD\U00010000-\U0010FFFF]"
                          "|[\x85\u2028\u2029\uFEFF]")


def double_quoted(s: str) -> str:
    """A YAML double-quoted scalar that reads back as exactly `s`, on one line, in any block or flow context."""
    q = json.dumps(s, ensure_ascii=False)
    return _YAML_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}" if ord(m.group()) < 0x10000
                            else f"\\U{ord(m.group()):08x}", q)


# the key written plainly or quoted, then its `:`; anchored at the end of the text before the value (same-line value) or
# at the start of the key's line (value on later lines, after blank or comment lines)
_KEY_END = re.compile(r"""(?:depends_on|"depends_on"|'depends_on')[ \t]*:[ \t]*\Z""")
_KEY_LINE = re.compile(r"""[ \t]*(?:-[ \t]+)*(?:depends_on|"depends_on"|'depends_on')[ \t]*(:)[ \t]*(?:#.*)?\Z""")


def _key_colon(text: str, value_start: int, agent_index: int) -> int:
    """Index in `text` of the `:` after agent `agent_index`'s `depends_on` key, whose value starts at `value_start`.
    Between a key's `:` and its value YAML allows only blanks, line breaks and comments, so a backward look over those
    finds it; anything unusual (an explicit `?` key, ...) is read off PyYAML's node tree instead (the key's end
    mark)."""
    line_start = text.rfind("\n", 0, value_start) + 1
    m = _KEY_END.search(text, line_start, value_start)
    if m:
        return text.index(":", m.start())
    end = line_start - 1 if not text[line_start:value_start].strip() else 0
    while end > 0:  # the value starts a line: walk back over blank and comment-only lines to the key's line
        start = text.rfind("\n", 0, end) + 1
        line = text[start:end].rstrip("\r")
        if line.strip() and not line.lstrip().startswith("#"):
            m = _KEY_LINE.match(line)
            if m:
                return start + m.start(1)
            break
        end = start - 1
    try:
        body, off = extract_yaml(text)
        root = yaml.compose(body, Loader=yaml.SafeLoader)
        agents = next(v for k, v in root.value if k.value == "agents")
        key = next(k for k, _ in agents.value[agent_index].value if k.value == "depends_on")
    except (yaml.YAMLError, StopIteration, AttributeError, IndexError, ValueError) as e:
        raise EditError(f"agents[{agent_index}]: cannot locate the depends_on key ({type(e).__name__}: {e})") from None
    i = key.end_mark.index
    # blanks and comments may sit between an explicit `?` key and its `:`
    while i < len(body) and body[i] in " \t\r\n#":
        i = body.find("\n", i) if body[i] == "#" else i + 1
        i = len(body) if i < 0 else i
    if i >= len(body) or body[i] != ":":
        raise EditError(f"agents[{agent_index}]: no ':' after the depends_on key")
    return off + i


# ---- the families: one record each (adding a family = one EditFamily in REGISTRY; tests/test_edits.py adds one) ---
@dataclass(frozen=True)
class EditFamily:
    """One counterfactual edit family: what the trainer, the plots and the spec inspector need to know of it."""

    name: str
    """Its key in configs (cf_families), metrics (cf/delta_<name>) and records."""
    label: str
    """How plots name it: the paper's symbol and what it does."""
    sites: Callable[[Spec, list, Prompts], list]
    """(spec, its live agents, prompts) -> the sites (tuples of agent ids) where the edit changes what is executed."""
    rewrite: Callable[[Spec, int, tuple, Prompts], tuple]
    """(spec, index of the site's agent, site, prompts) -> (span of the edited value, replaced region, replacement text,
    the expected edited agent); apply_edit re-parses and checks the result."""
    describe: Callable[[Spec, tuple], str]
    """(spec, site) -> what the edit does there, for the inspector ("drop a1 → a2")."""
    target: str | None = None
    """For a family that sets one agent field to a chosen value (capacity): that field. The inspector then lets any
    executed agent's field be set to any other of `target_values`, the family's own edit as the default; None = one
    outcome per site (edge, role)."""
    target_values: tuple[str, ...] = ()
    """The values `target` may take, in order (capacity: CAPACITIES)."""


def _edge_sites(spec: Spec, live: list, prompts: Prompts) -> list[tuple[str, ...]]:
    return [(a.id, d) for a in live for d in a.depends_on]


def _role_sites(spec: Spec, live: list, prompts: Prompts) -> list[tuple[str, ...]]:
    defaults = prompts.roles_for(None)
    missing = sorted({a.base_role for a in live} - set(defaults))
    if missing:  # parsed with a base-role list other than this prompts file's
        raise EditError(f"base roles {missing} have no default duty in the prompts file "
                        f"{prompts.path or '(packaged)'}; parse the spec with base_roles=prompts.roles_for(domain)")
    return [(a.id,) for a in live if a.duty != defaults[a.base_role]]


def _capacity_sites(spec: Spec, live: list, prompts: Prompts) -> list[tuple[str, ...]]:
    return [(a.id,) for a in live if a.capacity != CAPACITIES[0]]


def _edge_rewrite(spec: Spec, i: int, site: tuple[str, ...], prompts: Prompts):
    a, sp, t = spec.agents[i], spec.spans[i], spec.text
    j = a.depends_on.index(site[1])
    rest = tuple(d for d in a.depends_on if d != site[1])
    colon = _key_colon(t, sp.depends_on[0], i)
    # ` [..]` right after the colon is valid after every list style the parser accepts; the old list is dropped whole
    written = " [" + ", ".join(double_quoted(d) for d in rest) + "]"
    return sp.deps[j], (colon + 1, sp.depends_on[1]), written, dataclasses.replace(a, depends_on=rest)


def _role_rewrite(spec: Spec, i: int, site: tuple[str, ...], prompts: Prompts):
    a, sp = spec.agents[i], spec.spans[i]
    new = prompts.default_duty(a.base_role)
    return sp.duty, sp.duty, double_quoted(new), dataclasses.replace(a, duty=new)


def _capacity_rewrite(spec: Spec, i: int, site: tuple[str, ...], prompts: Prompts):
    a, sp = spec.agents[i], spec.spans[i]
    new = CAPACITIES[CAPACITIES.index(a.capacity) - 1]
    q = spec.text[sp.capacity[0]]
    written = f"{q}{new}{q}" if q in "\"'" else new  # keep the quoting: either form is valid where the old one was
    return sp.capacity, sp.capacity, written, dataclasses.replace(a, capacity=new)


REGISTRY: dict[str, EditFamily] = {f.name: f for f in (
    EditFamily("edge", "m_E (drop edge)", _edge_sites, _edge_rewrite, lambda spec, s: f"drop {s[1]} → {s[0]}"),
    EditFamily("role", "m_R (duty -> base role)", _role_sites, _role_rewrite,
               lambda spec, s: f"{s[0]}: duty → {spec.agent(s[0]).base_role} default"),
    EditFamily("capacity", "m_L (capacity -1)", _capacity_sites, _capacity_rewrite,
               lambda spec, s: f"{s[0]} (now {spec.agent(s[0]).capacity})", target="capacity",
               target_values=CAPACITIES),
)}
FAMILIES = tuple(REGISTRY)  # m_E, m_R, m_L: the order of every table and config default


def apply_edit(spec: Spec, family: str, site: tuple[str, ...], prompts: Prompts) -> Edit:
    """Apply one edit to a parsed spec (which must carry its text and spans). Raises EditError (a ValueError) when the
    edit cannot be applied; the returned Edit's spec is proven to equal the original with exactly the family's one
    change."""
    if spec.text is None or spec.spans is None:
        raise EditError("apply_edit needs a spec parsed from text (it edits the text and reports spans in it)")
    if site not in eligible_sites(spec, family, prompts):
        raise EditError(f"site {site} is not eligible for {family!r} in this spec")
    span, (r0, r1), written, want = REGISTRY[family].rewrite(spec, spec.index(site[0]), site, prompts)
    text = spec.text[:r0] + written + spec.text[r1:]
    where = f"{family} edit at {'>'.join(site)}"
    try:
        edited = parse_spec(text, base_roles=prompts.roles_for(None), max_agents=max(len(spec.agents), 1))
    except SpecError as e:
        raise EditError(f"{where} gave an invalid spec: {e}. Report the spec text; the edit must keep any "
                        "parsed spec valid") \
            from None
    i = spec.index(site[0])
    expected = spec.agents[:i] + (want,) + spec.agents[i + 1:]
    if edited.agents != expected or edited.final != spec.final:
        raise EditError(f"{where} changed more than the edited field (re-parsed spec differs elsewhere). Report "
                        "the spec text")
    return Edit(family, site, span, (r0, r1), text, edited)


def sample_edit(spec: Spec, prompts: Prompts, rng: random.Random, family_probs: Mapping[str, float] | None = None,
                families: Sequence[str] | None = None) -> Edit | None:
    """Choose a family among `families` (the allowed ones) that have an eligible site, with weights `family_probs`
    (missing families weigh 0; all-zero weights: uniform over those allowed families), then a site uniformly.
    Returns None when no allowed family has an eligible site (that rollout gets no counterfactual term).
    Never returns an edit of a family outside `families`. Raises EditError when the chosen edit cannot be applied (and
    ValueError for bad arguments); nothing else."""
    fams = tuple(FAMILIES if families is None else families)
    bad = [f for f in fams if f not in REGISTRY]
    if not fams or bad:
        raise ValueError(f"families must be a non-empty subset of {FAMILIES}; got {fams}")
    sites = {f: eligible_sites(spec, f, prompts) for f in fams}
    cands = [f for f in fams if sites[f]]
    if not cands:
        return None
    probs = family_probs if family_probs is not None else {f: 1.0 for f in fams}
    weights = [float(probs.get(f, 0.0)) for f in cands]
    if any(not w >= 0 for w in weights):  # also catches NaN
        raise ValueError(f"family weights must be >= 0, got {dict(zip(cands, weights))}")
    f = rng.choices(cands, weights=weights)[0] if sum(weights) > 0 else rng.choice(cands)
    return apply_edit(spec, f, rng.choice(sites[f]), prompts)


@dataclass
class FamilySampler:
    """Adaptive family choice: p(f) = floor + (1 - K*floor) * m_f / sum(m), with m_f the running mean of |delta| over
    the last `window` edits of family f (a family not yet tried gets `init`). The floor keeps every family explored even
    when its recent contrasts were zero. State round-trips through state_dict() for checkpoints."""

    floor: float = 0.1
    window: int = 50
    init: float = 1.0
    history: dict[str, list[float]] = field(default_factory=lambda: {f: [] for f in FAMILIES})

    def __post_init__(self):
        k = len(self.history)
        if not 0 <= self.floor <= 1 / max(k, 1):
            raise ValueError(f"floor={self.floor} must be in [0, 1/{k}] so the probabilities can sum to 1")
        if self.window < 1:
            raise ValueError("window must be >= 1")

    def means(self) -> dict[str, float]:
        return {f: (sum(h) / len(h) if h else self.init) for f, h in self.history.items()}

    def probs(self) -> dict[str, float]:
        m = self.means()
        total = sum(m.values())
        k = len(m)
        if total <= 0:
            return {f: 1 / k for f in m}
        return {f: self.floor + (1 - k * self.floor) * m[f] / total for f in m}

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
