"""The orchestration specification: schema, parsing with named errors, DAG levels, canonical YAML and field spans.

A spec is the YAML document the orchestrator writes (paper §3.1): a list of agents, each with an id, an inherited
`base_role`, a customized `role` name and `duty`, a `capacity` level (which worker model runs it) and `depends_on` (ids
of EARLIER agents), plus `final`, the agent whose output is the answer. Example:

    agents:
      - id: plan
        base_role: planner
        role: Step planner
        duty: List the steps.
        capacity: small
        depends_on: []
      - {id: solve, base_role: solver, role: Solver, duty: Follow the plan., capacity: large, depends_on: [plan]}
    final: solve

We build the Spec from PyYAML's *node* tree rather than `safe_load`, for three reasons: every node carries its character
offsets (the counterfactual loss needs the span of each edited value in the text the model wrote), duplicate keys can be
rejected (safe_load silently keeps the last), and no Python object is ever constructed from untrusted tags.
The named errors are in lemon.spec.errors (re-exported here), the YAML plumbing in lemon.spec.yamlio.
"""
from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import yaml

from lemon.prompts import CAPACITIES, default_prompts
from lemon.spec.errors import (BadFinalError, BadTextError, BadIdError, DuplicateDependencyError,  # noqa: F401
                               DuplicateIdError, EmptyError, ForwardDependencyError, MissingFieldError, NotMappingError,
                               NoYamlError, SelfDependencyError, SpecError, TooLongError, TooManyAgentsError,
                               UnknownBaseRoleError, UnknownCapacityError, UnknownDependencyError, UnknownFieldError,
                               WrongTypeError, YamlSyntaxError)  # re-exported
# extract_yaml is re-exported
from lemon.spec.yamlio import _STR_TAG, Span, _kind, _mapping, _span, extract_yaml  # noqa: F401

MAX_AGENTS = 8
MAX_TEXT_CHARS = 12_000
MAX_LEN = {"id": 32, "base_role": 32, "role": 80, "duty": 500, "capacity": 16}
AGENT_FIELDS = ("id", "base_role", "role", "duty", "capacity", "depends_on")
REQUIRED_FIELDS = ("id", "base_role", "role", "duty", "capacity")  # depends_on defaults to []
ID_RE = re.compile(r"[A-Za-z][A-Za-z0-9_\-]*\Z")




@dataclass(frozen=True)
class Agent:
    id: str
    base_role: str
    role: str
    duty: str
    capacity: str
    depends_on: tuple[str, ...] = ()


@dataclass(frozen=True)
class AgentSpans:
    """Character spans of one agent's values in Spec.text (quotes included for quoted scalars)."""

    role: Span
    duty: Span
    capacity: Span
    depends_on: Span | None  # the whole list; None when the field was omitted
    deps: tuple[Span, ...] = ()  # one span per list item, aligned with Agent.depends_on


@dataclass(frozen=True)
class Spec:
    agents: tuple[Agent, ...]
    final: str
    text: str | None = field(default=None, compare=False)  # the text as written (None for specs built in code)
    spans: tuple[AgentSpans, ...] | None = field(default=None, compare=False)

    # ---- graph -------------------------------------------------------------------------------------------------
    def agent(self, agent_id: str) -> Agent:
        for a in self.agents:
            if a.id == agent_id:
                return a
        raise KeyError(agent_id)

    def index(self, agent_id: str) -> int:
        return [a.id for a in self.agents].index(agent_id)

    def edges(self) -> list[tuple[str, str]]:
        """(parent, child) pairs."""
        return [(d, a.id) for a in self.agents for d in a.depends_on]

    def levels(self) -> list[list[str]]:
        """Topological levels: level(a) = 0 without dependencies, else 1 + max level of its parents. Agents of one level
        depend only on earlier levels, so they may run concurrently."""
        lvl: dict[str, int] = {}
        for a in self.agents:  # dependencies point backwards, so one pass in order suffices
            lvl[a.id] = 1 + max((lvl[d] for d in a.depends_on), default=-1)
        out: list[list[str]] = [[] for _ in range(max(lvl.values()) + 1)]
        for a in self.agents:
            out[lvl[a.id]].append(a.id)
        return out

    def ancestors(self, agent_id: str) -> set[str]:
        seen: set[str] = set()
        stack = list(self.agent(agent_id).depends_on)
        while stack:
            d = stack.pop()
            if d not in seen:
                seen.add(d)
                stack.extend(self.agent(d).depends_on)
        return seen

    def descendants(self, agent_id: str) -> set[str]:
        return {a.id for a in self.agents if agent_id in self.ancestors(a.id)}

    def unreachable(self) -> list[str]:
        """Agents whose output can never reach `final` (wasted work; the graph cost counts them)."""
        keep = self.ancestors(self.final) | {self.final}
        return [a.id for a in self.agents if a.id not in keep]

    # ---- serialisation -----------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"agents": [{f: (list(getattr(a, f)) if f == "depends_on" else getattr(a, f)) for f in AGENT_FIELDS}
                           for a in self.agents], "final": self.final}

    def to_yaml(self) -> str:
        """Canonical, deterministic YAML, the SFT target format and exactly the language of lemon.spec.grammar for a
        canonical() spec: block agents, fixed field order, role and duty always double-quoted (JSON) strings, flow-style
        depends_on, other strings plain unless a plain scalar could be misread. parse_spec(spec.to_yaml()) == spec."""
        lines = ["agents:"]
        for a in self.agents:
            lines.append(f"  - id: {_scalar(a.id)}")
            lines.append(f"    base_role: {_scalar(a.base_role)}")
            lines.append(f"    role: {json.dumps(a.role, ensure_ascii=False)}")
            lines.append(f"    duty: {json.dumps(a.duty, ensure_ascii=False)}")
            lines.append(f"    capacity: {_scalar(a.capacity)}")
            lines.append(f"    depends_on: [{', '.join(_scalar(d) for d in a.depends_on)}]")
        lines.append(f"final: {_scalar(self.final)}")
        return "\n".join(lines) + "\n"


_PLAIN_OK = re.compile(r"[A-Za-z][A-Za-z0-9 _\-.,;()'/?!+*=<>]*\Z")


def _scalar(s: str) -> str:
    """A plain scalar when it is unambiguous text, else a double-quoted (JSON) scalar, which YAML reads identically."""
    if _PLAIN_OK.match(s) and not s.endswith((" ", ":")) and ": " not in s and " #" not in s \
            and yaml.safe_load(s) == s:
        return s
    return json.dumps(s, ensure_ascii=False)


# ---- the canonical form (lemon.spec.grammar's language) --------------------------------------------------------------
# role / duty alphabet of the constrained grammar: ASCII letters, digits, space and TEXT_PUNCT; no quote, backslash,
# colon or '#', so a double-quoted value needs no escape and cannot end the YAML scalar early. Starts with a letter,
# ends with a non-space (parse_spec strips values, so a trailing space could not round-trip).
TEXT_PUNCT = " ,.;()'/?!+*=<>-"
# grammar bounds: an unbounded string ran to the token cap (2 of 4 samples at T=1; lemon.spec.grammar)
ROLE_CHARS, DUTY_CHARS = 48, 200
_TEXT_MAP = {":": " -", '"': "'", "\\": "/", "#": "no. ", "%": " percent", "&": " and ", "_": " ", "[": "(", "]": ")",
             "{": "(", "}": ")", "|": "/", "`": "'", "\u2018": "'", "\u2019": "'", "\u201c": "'", "\u201d": "'",
             "\u2013": "-", "\u2014": "-", "\u2212": "-", "\u00d7": "*", "\u00f7": "/"}


def clean_text(s: str, max_chars: int) -> str:
    """s in the grammar's role/duty alphabet: mapped punctuation (':' -> ' -', '"' -> "'", ...), accents dropped (NFKD),
    other characters removed, whitespace runs collapsed, leading non-letters dropped, clipped to max_chars. '' if
    nothing is left. Identity on text already in the alphabet with single spaces."""
    out = []
    for ch in s:
        ch = _TEXT_MAP.get(ch, ch)
        if ch.isspace():
            ch = " "
        for c in unicodedata.normalize("NFKD", ch):
            if c.isascii() and (c.isalnum() or c in TEXT_PUNCT):
                out.append(c)
    t = re.sub(r" {2,}", " ", "".join(out))
    t = re.sub(r"^[^A-Za-z]+", "", t)
    return t[:max_chars].rstrip()


def canonical(spec: Spec, *, role_chars: int = ROLE_CHARS, duty_chars: int = DUTY_CHARS) -> Spec:
    """The spec in lemon.spec.grammar's language, so any valid spec can become an SFT target the constrained policy can
    write: agents after `final` dropped (dependencies point backwards, so they cannot reach it) and `final` is the last
    agent; ids renamed a1..an by position, depends_on remapped and sorted by position; role / duty through clean_text
    (an emptied role falls back to the base role's name, an emptied duty to a generic one). The result is built in code
    (no text): parse its to_yaml() for spans."""
    keep = spec.agents[:spec.index(spec.final) + 1]
    new_id = {a.id: f"a{i + 1}" for i, a in enumerate(keep)}
    agents = []
    for a in keep:
        role = clean_text(a.role, role_chars) or clean_text(a.base_role, role_chars) or "Agent"
        duty = clean_text(a.duty, duty_chars) or "Do your part of the task."
        deps = tuple(sorted((new_id[d] for d in a.depends_on), key=lambda d: int(d[1:])))
        agents.append(Agent(new_id[a.id], a.base_role, role, duty, a.capacity, deps))
    return Spec(tuple(agents), new_id[spec.final])


# ---- parsing -------------------------------------------------------------------------------------------------------
def parse_spec(text: str, *, base_roles: Iterable[str] | None = None, max_agents: int = MAX_AGENTS) -> Spec:
    """Parse and validate a spec (or an orchestrator completion that wraps one). Raises a SpecError subclass on any
    invalid input; nothing else escapes. `base_roles` defaults to every role in the packaged prompts file."""
    if not isinstance(text, str):
        raise WrongTypeError(f"spec text must be str, got {type(text).__name__}", "text")
    if len(text) > MAX_TEXT_CHARS:
        raise TooLongError(f"{len(text)} characters > {MAX_TEXT_CHARS}", "text")
    roles = set(base_roles) if base_roles is not None else set(default_prompts().roles_for(None))
    body, off = extract_yaml(text)
    try:
        nodes = list(yaml.compose_all(body, Loader=yaml.SafeLoader))
    except yaml.YAMLError as e:
        raise YamlSyntaxError(str(e).replace("\n", " "), "yaml") from None
    except (ValueError, RecursionError, MemoryError) as e:  # pathological nesting
        raise YamlSyntaxError(f"{type(e).__name__}: {e}", "yaml") from None
    nodes = [n for n in nodes if n is not None]
    if len(nodes) != 1:
        raise YamlSyntaxError(f"expected one YAML document, found {len(nodes)}", "yaml")
    return _build(nodes[0], text, off, roles, max_agents)


def _join_surrogates(s: str, where: str, name: str) -> str:
    """JSON's escapes of an astral character ("\\ud83d\\ude00", json.dumps' default for an emoji) reach us as two lone
    surrogates, which cannot be encoded, re-dumped or tokenized: join the pairs; a lone one is not text
    (BadTextError)."""
    if not any("\ud800" <= c <= "\udfff" for c in s):
        return s
    try:
        return s.encode("utf-16", "surrogatepass").decode("utf-16")
    except UnicodeDecodeError:
        raise BadTextError(f"{name} holds a lone UTF-16 surrogate escape", where) from None


def _string(node, where: str, name: str) -> str:
    if not isinstance(node, yaml.ScalarNode) or node.tag != _STR_TAG:
        raise WrongTypeError(f"{name} must be a string, got {_kind(node)}", where)
    s = _join_surrogates(node.value, where, name).strip()
    if not s:
        raise EmptyError(f"{name} is empty", where)
    if len(s) > MAX_LEN[name]:
        raise TooLongError(f"{name} has {len(s)} characters > {MAX_LEN[name]}", where)
    return s


def _build(root, text: str, off: int, roles: set[str], max_agents: int) -> Spec:
    seen: set[int] = set()
    top = _mapping(root, "spec", seen)
    for k in top:
        if k not in ("agents", "final"):
            raise UnknownFieldError(f"unknown top-level field {k!r} (allowed: agents, final)", "spec")
    if "agents" not in top:
        raise MissingFieldError("no `agents` list", "spec")
    anode = top["agents"][1]
    if not isinstance(anode, yaml.SequenceNode):
        raise WrongTypeError(f"agents must be a list, got {_kind(anode)}", "agents")
    if not anode.value:
        raise EmptyError("agents is an empty list", "agents")
    if len(anode.value) > max_agents:
        raise TooManyAgentsError(f"{len(anode.value)} agents > max_agents={max_agents}", "agents")
    # every id written anywhere, so a reference to a later agent is told apart from a typo
    all_ids = {v.value for n in anode.value if isinstance(n, yaml.MappingNode)
               for k, v in n.value
               if isinstance(k, yaml.ScalarNode) and k.value == "id" and isinstance(v, yaml.ScalarNode)}
    agents: list[Agent] = []
    spans: list[AgentSpans] = []
    ids: list[str] = []
    for i, node in enumerate(anode.value):
        where = f"agents[{i}]"
        m = _mapping(node, where, seen)
        for k in m:
            if k not in AGENT_FIELDS:
                raise UnknownFieldError(f"unknown field {k!r} (allowed: {', '.join(AGENT_FIELDS)})", where)
        for k in REQUIRED_FIELDS:
            if k not in m:
                raise MissingFieldError(f"missing field {k!r}", where)
        vals = {k: _string(m[k][1], where, k) for k in REQUIRED_FIELDS}
        aid = vals["id"]
        where = f"agents[{i}] (id {aid!r})"
        if not ID_RE.match(aid):
            raise BadIdError(f"id {aid!r} is not a slug (letter, then letters/digits/_/-)", where)
        if aid in ids:
            raise DuplicateIdError(f"id {aid!r} is already used by agents[{ids.index(aid)}]", where)
        if vals["capacity"] not in CAPACITIES:
            raise UnknownCapacityError(f"capacity {vals['capacity']!r}; valid: {', '.join(CAPACITIES)}", where)
        if vals["base_role"] not in roles:
            raise UnknownBaseRoleError(f"base_role {vals['base_role']!r}; valid: {', '.join(sorted(roles))}", where)
        deps, dep_spans, dep_span = _deps(m.get("depends_on"), ids, all_ids, aid, where, off)
        agents.append(Agent(aid, vals["base_role"], vals["role"], vals["duty"], vals["capacity"], deps))
        spans.append(AgentSpans(_span(m["role"][1], off), _span(m["duty"][1], off), _span(m["capacity"][1], off),
                                dep_span, dep_spans))
        ids.append(aid)
    final = ids[-1]
    if "final" in top:
        fnode = top["final"][1]
        if not isinstance(fnode, yaml.ScalarNode) or fnode.tag != _STR_TAG:
            raise WrongTypeError(f"final must be an agent id string, got {_kind(fnode)}", "final")
        final = fnode.value.strip()
        if final not in ids:
            raise BadFinalError(f"final {final!r} is not an agent id ({', '.join(ids)})", "final")
    return Spec(tuple(agents), final, text, tuple(spans))


def _deps(entry, earlier: list[str], all_ids: set[str], aid: str, where: str, off: int):
    if entry is None:
        return (), (), None
    node = entry[1]
    if isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:null":
        return (), (), _span(node, off)  # `depends_on:` with no value reads as "none"
    if not isinstance(node, yaml.SequenceNode):
        raise WrongTypeError(f"depends_on must be a list of ids, got {_kind(node)}", where)
    deps: list[str] = []
    for item in node.value:
        if not isinstance(item, yaml.ScalarNode) or item.tag != _STR_TAG:
            raise WrongTypeError(f"depends_on items must be agent ids, got {_kind(item)}", where)
        d = item.value.strip()
        if d == aid:
            raise SelfDependencyError(f"{aid!r} depends on itself", where)
        if d in deps:
            raise DuplicateDependencyError(f"{d!r} listed twice in depends_on", where)
        if d not in earlier:
            if d in all_ids:
                raise ForwardDependencyError(f"{d!r} is defined later; depend only on earlier agents", where)
            raise UnknownDependencyError(f"{d!r} is not an agent id (earlier ids: {earlier or 'none'})", where)
        deps.append(d)
    return tuple(deps), tuple(_span(i, off) for i in node.value), _span(node, off)


def json_schema(base_roles: Iterable[str] | None = None, max_agents: int = MAX_AGENTS) -> dict:
    """JSON Schema of a spec, for constrained decoding (JSON is YAML, so a constrained JSON answer goes through
    parse_spec). It cannot express 'depends_on names earlier ids'; parse_spec still checks that."""
    roles = sorted(base_roles) if base_roles is not None else sorted(default_prompts().roles_for(None))
    s = lambda n: {"type": "string", "minLength": 1, "maxLength": n}  # noqa: E731
    agent = {"type": "object", "additionalProperties": False, "required": list(AGENT_FIELDS),
             "properties": {"id": {"type": "string", "pattern": "^[A-Za-z][A-Za-z0-9_-]{0,31}$"},
                            "base_role": {"enum": roles}, "role": s(MAX_LEN["role"]), "duty": s(MAX_LEN["duty"]),
                            "capacity": {"enum": list(CAPACITIES)},
                            "depends_on": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}}
    return {"type": "object", "additionalProperties": False, "required": ["agents", "final"],
            "properties": {"agents": {"type": "array", "minItems": 1, "maxItems": max_agents, "items": agent},
                           "final": {"type": "string"}}}


def spec_from_dict(d: Mapping, **kw) -> Spec:
    """Build (and validate) a spec from plain data, via its canonical YAML so that text and spans are always present."""
    agents = [Agent(a["id"], a["base_role"], a["role"], a["duty"], a["capacity"], tuple(a.get("depends_on", ())))
              for a in d["agents"]]
    return parse_spec(Spec(tuple(agents), d.get("final") or agents[-1].id).to_yaml(), **kw)
