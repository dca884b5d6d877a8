"""Counterfactual edits: one field changes, spans point into the original text, no-op sites are never eligible, and
(fuzzed) every edit of every spec the parser accepts, in every YAML style it accepts, gives a valid spec with exactly
that change."""
import dataclasses
import json
import random

import pytest
import yaml

from lemon.prompts import CAPACITIES, default_prompts
from lemon.spec import Spec, parse_spec, spec_from_dict
from lemon.train.edits import FAMILIES, EditError, FamilySampler, apply_edit, double_quoted, eligible_sites, sample_edit

P = default_prompts()
ROLES = sorted(P.roles_for(None))
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
FLOW = ('{"agents": [{"id": "a", "base_role": "solver", "role": "A", "duty": "Do A.", "capacity": "large", '
        '"depends_on": []}, {"id": "b", "base_role": "decider", "role": "B", "duty": "Do B.", "capacity": "medium", '
        '"depends_on": ["a"]}]}')
# PyYAML's default dump: `depends_on:` then `- a` at the key's own indentation (an indentless list); issue 11, defect 1
INDENTLESS = """agents:
- base_role: planner
  capacity: medium
  depends_on: []
  duty: Plan it.
  id: a
  role: A
- base_role: solver
  capacity: large
  depends_on:
  - a
  duty: Solve it.
  id: b
  role: B
final: b
"""


def test_eligibility_excludes_noops_and_dead_agents():
    s = parse_spec(BLOCK)
    assert s.unreachable() == ["idle"]
    # plan's duty IS the planner default -> not eligible; idle is unreachable -> nothing of it is eligible
    assert eligible_sites(s, "role", P) == [("solve",), ("check",)]
    assert eligible_sites(s, "capacity", P) == [("solve",), ("check",)]  # plan is already small
    assert eligible_sites(s, "edge", P) == [("solve", "plan"), ("check", "plan"), ("check", "solve")]
    with pytest.raises(ValueError, match="valid: edge, role, capacity"):
        eligible_sites(s, "colour", P)


def _check_edit(text: str, s: Spec, fam: str, site: tuple, e, reparse: bool = True) -> None:
    """(a) the edited text parses, (b) to the original with exactly the one change, (c) span/replaced point at the old
    value in the ORIGINAL text, and text outside `replaced` is untouched (unchanged agents stay byte-identical)."""
    edited = parse_spec(e.text) if reparse else e.spec  # (a): apply_edit itself parses e.text into e.spec
    assert e.spec.text == e.text
    i = s.index(site[0])
    a = s.agents[i]
    if fam == "edge":
        change = {"depends_on": tuple(d for d in a.depends_on if d != site[1])}
    elif fam == "role":
        change = {"duty": P.default_duty(a.base_role)}
    else:
        change = {"capacity": CAPACITIES[CAPACITIES.index(a.capacity) - 1]}
    want = dataclasses.replace(a, **change)
    assert edited.agents == s.agents[:i] + (want,) + s.agents[i + 1:] and edited.final == s.final  # (b)
    assert e.spec.agents == edited.agents
    assert 0 <= e.replaced[0] <= e.span[0] < e.span[1] <= e.replaced[1] <= len(text)  # (c)
    frag = text[e.span[0]:e.span[1]]
    if fam == "capacity":
        assert frag.strip("'\"") == a.capacity
    elif fam == "edge":
        assert frag.strip("'\"") == site[1]
    else:
        assert _pairs(yaml.safe_load(frag)) == a.duty  # parse_spec joins JSON's surrogate escapes too
    assert e.text.startswith(text[:e.replaced[0]]) and e.text.endswith(text[e.replaced[1]:])


@pytest.mark.parametrize("text", [BLOCK, FLOW, INDENTLESS])
def test_every_edit_changes_exactly_one_field(text):
    s = parse_spec(text)
    n = 0
    for fam in FAMILIES:
        for site in eligible_sites(s, fam, P):
            _check_edit(text, s, fam, site, apply_edit(s, fam, site, P))
            n += 1
    assert n > 0


def test_edge_edit_after_an_explicit_key_with_a_comment():
    # no `depends_on:` on one line: the colon is found on PyYAML's node tree, past the comment
    text = INDENTLESS.replace("  depends_on:\n  - a\n", "  ? depends_on\n  # parents\n  : - a\n")
    s = parse_spec(text)
    assert s.agents[1].depends_on == ("a",)
    e = apply_edit(s, "edge", ("b", "a"), P)
    _check_edit(text, s, "edge", ("b", "a"), e)
    assert "  ? depends_on\n  # parents\n  : []\n" in e.text
    escaped = FLOW.replace('"depends_on": ["a"]', '"depends\\u005fon": ["a"]')  # the key spelled with an escape
    s = parse_spec(escaped)
    assert s.agents[1].depends_on == ("a",)
    _check_edit(escaped, s, "edge", ("b", "a"), apply_edit(s, "edge", ("b", "a"), P))


def test_role_edit_of_block_scalar_and_quoted_capacity_stay_valid():
    s = parse_spec(BLOCK)
    e = apply_edit(s, "role", ("solve",), P)
    assert e.text[e.replaced[0]:].startswith(double_quoted(P.default_duty("solver")) + "\n    capacity: \"large\"")
    e = apply_edit(s, "capacity", ("solve",), P)
    assert '    capacity: "medium"\n' in e.text


# ---- the fuzz test -------------------------------------------------------------------------------------------------
PIECES = ["plan", "the", "steps", "Compute", "x", "42", "3.5", ": ", " #", "#", "'", '"', "é", "漢字", "😀", "- ", "? ",
          "[a]", "{b}", "&c", "*d", "!e", "%", "@", "`", "|", ">", "\\", ",", "yes", "null", "~", "\t", "—", "\u00a0"]
STARTS = ["", "- ", "-5 ", "? ", "# ", "'", '"', "[", "{", "&", "*", "!", "|", ">", "@", "%", "`", "yes", "null ", "0x"]
IDS = ["on", "no", "null", "true", "y", "n", "a-b", "x_1", "Off"]


def _text(rng, n_max):
    s = rng.choice(STARTS) + "".join(rng.choice(PIECES + [" "] * 6) for _ in range(rng.randint(1, 14)))
    if rng.random() < 0.1:
        s += "\n" + rng.choice(PIECES) + " more"
    s = s.strip()[:n_max].strip()
    return s or "x"


def random_spec(rng) -> dict:
    n = rng.randint(1, 8)
    pool = IDS + [f"a{k}" for k in range(20)]
    ids = rng.sample(pool, n)
    agents = []
    for k, aid in enumerate(ids):
        base = rng.choice(ROLES)
        duty = P.default_duty(base) if rng.random() < 0.15 else _text(rng, 500)
        deps = rng.sample(ids[:k], rng.randint(0, min(k, 3))) if k else []
        agents.append({"id": aid, "base_role": base, "role": _text(rng, 80), "duty": duty,
                       "capacity": rng.choice(CAPACITIES), "depends_on": deps})
    final = ids[-1] if rng.random() < 0.7 else rng.choice(ids)
    return {"agents": agents, "final": final}


class _Indented(yaml.SafeDumper):
    def increase_indent(self, flow=False, indentless=False):  # block lists indented under their key
        return super().increase_indent(flow, False)


def _ok_plain(v: str, ctx: str) -> bool:
    doc = f"k: {v}\n" if ctx == "block" else f"{{k: {v}}}"
    try:
        return "\n" not in v and yaml.safe_load(doc) == {"k": v}
    except yaml.YAMLError:
        return False


def _scalar(v: str, rng, ctx: str, indent: str, block: bool = False) -> str:
    """A random way of writing `v` that YAML reads back as `v` in context `ctx` (block / flow); `block` allows | and
    >."""
    kinds = ["double", "json_ascii"] + ["single"] * ("\n" not in v) + ["plain"] * _ok_plain(v, ctx) * 2
    lines = v.split("\n")
    if block and ctx == "block" and all(ln and ln == ln.strip() for ln in lines):
        kinds += ["literal"] if len(lines) > 1 else ["literal", "folded"]  # folding would join several lines
    k = rng.choice(kinds)
    if k == "plain":
        return v
    if k == "single":
        return "'" + v.replace("'", "''") + "'"
    if k == "json_ascii":
        return json.dumps(v)
    if k in ("literal", "folded"):
        head = ("|" if k == "literal" else ">") + rng.choice(["", "-", "+"]) + rng.choice(["", "  # block"])
        return head + "".join(f"\n{indent}  {ln}" for ln in lines)
    return json.dumps(v, ensure_ascii=False)


def hand_yaml(d: dict, rng) -> str:
    """Our own emitter: random quoting per value (and per key), block / indentless / flow (same or next line) dependency
    lists, `[]`, null or omitted empty lists, flow-mapping agents, comments on lines and between fields, 2 or 4
    spaces."""
    ind = rng.choice(["  ", "    "])
    out = ["# spec written by hand", "agents:"]
    com = lambda: rng.choice(["", "", "  # note: x", "   #c"])  # noqa: E731
    for a in d["agents"]:
        if rng.random() < 0.15:  # a flow-mapping agent
            fields = [f"{k}: {_scalar(a[k], rng, 'flow', '')}" for k in ("id", "base_role", "role", "duty", "capacity")]
            if a["depends_on"] or rng.random() < 0.5:
                fields.append("depends_on: [" + ", ".join(_scalar(x, rng, "flow", "") for x in a["depends_on"]) + "]")
            out.append(f"{ind}- {{{', '.join(fields)}}}" + com())
            continue
        keys = ["id", "base_role", "role", "duty", "capacity", "depends_on"]
        rng.shuffle(keys)
        first = True
        for k in keys:
            lead = f"{ind}- " if first else f"{ind}  "
            inner = f"{ind}  "
            key = rng.choice([k] * 8 + [f'"{k}"', f"'{k}'"])
            if k == "depends_on":
                deps = a["depends_on"]
                style = rng.choice(["flow", "flow_next_line", "block", "indentless"]
                                   + (["empty", "null", "omit"] if not deps else []))
                flow = "[" + rng.choice([", ", ","]).join(_scalar(x, rng, "flow", "") for x in deps) + "]"
                if style == "omit":
                    continue
                if style in ("empty", "null", "flow"):
                    out.append(f"{lead}{key}:" + {"empty": " []", "null": "", "flow": " " + flow}[style] + com())
                elif style == "flow_next_line":
                    out += [f"{lead}{key}:" + com(), f"{inner}  {flow}"]
                else:
                    out.append(f"{lead}{key}:" + com())
                    pad = inner + ("  " if style == "block" else "")
                    out += [f"{pad}- {_scalar(x, rng, 'block', pad)}" + com() for x in deps]
            else:
                val = _scalar(a[k], rng, "block", inner, block=k in ("role", "duty"))
                out.append(f"{lead}{key}: {val}" + ("" if "\n" in val else com()))
            first = False
            if rng.random() < 0.1:
                out.append(f"{inner}# a comment line")
    if d["final"] != d["agents"][-1]["id"] or rng.random() < 0.5:
        out.append(f"final: {_scalar(d['final'], rng, 'block', '')}")
    return "\n".join(out) + "\n"


def _fence(t: str, rng) -> str:
    return f"Sure, here is the plan:\n\n```{rng.choice(['yaml', ''])}\n{t}```\nIt should work.\n"


STYLES = {
    "pyyaml_default": lambda d, rng: yaml.safe_dump(d, sort_keys=rng.random() < 0.5, allow_unicode=rng.random() < 0.5),
    "pyyaml_flow_leaves": lambda d, rng: yaml.safe_dump(d, default_flow_style=None, allow_unicode=True),
    "indented_block": lambda d, rng: yaml.dump(d, Dumper=_Indented, sort_keys=False, allow_unicode=True),
    "canonical": lambda d, rng: spec_from_dict(d).text,  # Spec.to_yaml: flow dependency lists
    "json": lambda d, rng: json.dumps(d, indent=2, ensure_ascii=rng.random() < 0.5),
    "json_compact": lambda d, rng: json.dumps(d, separators=(",", ":"), ensure_ascii=False),
    "hand": hand_yaml,
    "hand_crlf": lambda d, rng: hand_yaml(d, rng).replace("\n", "\r\n"),
    "fenced_pyyaml": lambda d, rng: _fence(yaml.safe_dump(d, allow_unicode=True), rng),
    "fenced_hand_crlf": lambda d, rng: _fence(hand_yaml(d, rng), rng).replace("\n", "\r\n"),
}


def fuzz_cases(n_specs: int, seed: int = 0):
    """(style, text, parsed spec) for n_specs random specs, styles taken in turn."""
    rng = random.Random(seed)
    names = list(STYLES)
    for k in range(n_specs):
        style = names[k % len(names)]
        d = random_spec(rng)
        text = STYLES[style](d, rng)
        s = parse_spec(text)  # a generator bug, not an edit bug, if this raises or differs from d
        assert [[_pairs(getattr(a, f)) for f in ("id", "role", "duty", "depends_on")] for a in s.agents] == \
            [[_pairs(a[f]) for f in ("id", "role", "duty", "depends_on")] for a in d["agents"]], (style, text)
        yield style, text, s


def _pairs(v):
    """JSON's ensure_ascii writes an emoji as a surrogate pair, which PyYAML reads as two lone surrogates: join them."""
    if isinstance(v, (list, tuple)):
        return [_pairs(x) for x in v]
    return v.encode("utf-16", "surrogatepass").decode("utf-16").strip()


def test_fuzz_every_edit_of_every_style_is_exact():
    n_edits, n_fam, failures = 0, {f: 0 for f in FAMILIES}, []
    for style, text, s in fuzz_cases(330):
        for fam in FAMILIES:
            for site in eligible_sites(s, fam, P):
                n_edits += 1
                n_fam[fam] += 1
                try:
                    _check_edit(text, s, fam, site, apply_edit(s, fam, site, P), reparse=False)
                except (AssertionError, ValueError) as ex:
                    failures.append((style, fam, site, repr(ex)[:200], text))
    assert not failures, f"{len(failures)} of {n_edits} edits failed; first: {failures[0]}"
    assert min(n_fam.values()) >= 200, n_fam  # every family is exercised in earnest


def test_ineligible_site_and_unparsed_spec_refused():
    s = parse_spec(BLOCK)
    with pytest.raises(EditError, match="not eligible"):
        apply_edit(s, "capacity", ("plan",), P)
    with pytest.raises(EditError, match="parsed from text"):
        apply_edit(Spec(s.agents, s.final), "capacity", ("solve",), P)
    assert issubclass(EditError, ValueError)  # callers catching ValueError (lemon.study) keep working


def test_unknown_base_role_is_an_edit_error_not_a_key_error():
    s = parse_spec(INDENTLESS.replace("base_role: solver", "base_role: oracle"), base_roles=ROLES + ["oracle"])
    with pytest.raises(EditError, match="no default duty"):
        sample_edit(s, P, random.Random(0), {"edge": 0.0, "role": 1.0, "capacity": 0.0})


def test_edit_that_breaks_the_spec_raises_edit_error():
    # a base role whose default duty is longer than a duty may be: the rewritten spec no longer validates
    from dataclasses import replace
    long = replace(P, base_roles={**P.base_roles, "common": {**P.base_roles["common"], "planner": "x" * 600}})
    s = parse_spec(INDENTLESS)
    with pytest.raises(EditError, match="invalid spec"):
        apply_edit(s, "role", ("a",), long)


def test_sample_edit_none_when_nothing_eligible():
    s = parse_spec('agents:\n  - {id: a, base_role: solver, role: A, '
                   'duty: "Solve the problem step by step and state the final numeric result.", capacity: small}\n')
    assert sample_edit(s, P, random.Random(0)) is None


def test_sample_edit_follows_family_probs():
    s = parse_spec(BLOCK)
    rng = random.Random(0)
    fams = [sample_edit(s, P, rng, {"edge": 0.0, "role": 1.0, "capacity": 0.0}).family for _ in range(20)]
    assert set(fams) == {"role"}


def test_sample_edit_never_leaves_the_allowed_families():
    """Issue 11, item 11: allowed families all at weight 0 used to fall back to ANY family with a site."""
    s = parse_spec(BLOCK)
    rng = random.Random(0)
    zero_allowed = {"edge": 1.0, "role": 0.0, "capacity": 0.0}
    got = {sample_edit(s, P, rng, zero_allowed, families=("role", "capacity")).family for _ in range(40)}
    assert got == {"role", "capacity"}  # uniform over the allowed ones, never "edge"
    assert {sample_edit(s, P, rng, None, families=("capacity",)).family for _ in range(10)} == {"capacity"}
    only_role_eligible = parse_spec('agents:\n  - {id: a, base_role: solver, role: A, duty: Do it., capacity: small}\n')
    assert sample_edit(only_role_eligible, P, rng, families=("edge", "capacity")) is None
    with pytest.raises(ValueError, match="subset"):
        sample_edit(s, P, rng, families=("colour",))
    with pytest.raises(ValueError, match=">= 0"):
        sample_edit(s, P, rng, {"edge": -1.0, "role": 1.0, "capacity": 1.0})


def test_double_quoted_reads_back_exactly():
    for v in ["plain", 'say "hi": now #1', "tab\there", "line\u2028sep", "nel\x85", "bom\ufeff", "😀 漢字",
              "back\\slash"]:
        assert yaml.safe_load(f"k: {double_quoted(v)}") == {"k": v}
        assert "\n" not in double_quoted(v)


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


TOY_FAMILY = r'''
import dataclasses, json, random
import lemon.train.edits as E
from lemon.prompts import CAPACITIES, default_prompts

def sites(spec, live, prompts):
    return [(a.id,) for a in live if a.capacity != CAPACITIES[-1]]

def rewrite(spec, i, site, prompts):
    a, sp = spec.agents[i], spec.spans[i]
    new = CAPACITIES[CAPACITIES.index(a.capacity) + 1]
    return sp.capacity, sp.capacity, new, dataclasses.replace(a, capacity=new)

# the one record a new family is (written here before the rest of lemon is imported, as a line in edits.py would be);
# like capacity it takes a target value, which it says in its record
E.REGISTRY["upgrade"] = E.EditFamily("upgrade", "m_U (capacity +1)", sites, rewrite, lambda spec, s: f"raise {s[0]}",
                                     target="capacity", target_values=CAPACITIES)
E.FAMILIES = tuple(E.REGISTRY)

from types import SimpleNamespace
from lemon import benchmarks as B
from lemon.spec import parse_spec
from lemon.study.config import VARIANTS, StudyConfig, study_preset
from lemon.study.widgets import SpecInspector
from lemon.study.plots import FAMILY_LABEL
from lemon.testbed.experiment import ARMS
from lemon.train.config import train_preset
from lemon.train.edits import FamilySampler, apply_edit, sample_edit

P = default_prompts()
text = ("agents:\n  - id: a1\n    base_role: solver\n    role: \"Solver\"\n    duty: \"Compute it.\"\n"
        "    capacity: small\n    depends_on: []\nfinal: a1\n")
spec = parse_spec(text, base_roles=P.roles_for(None))
e = sample_edit(spec, P, random.Random(0), families=("upgrade",))
print(json.dumps({"edited": e.spec.agents[0].capacity, "span": text[e.span[0]:e.span[1]], "family": e.family,
                  "config": train_preset("smoke", cf_families=("upgrade",)).cf_families,
                  "sampler": sorted(FamilySampler().probs()), "label": FAMILY_LABEL["upgrade"],
                  "arm": ARMS["upgrade"], "variant": VARIANTS["upgrade"],
                  "describe": E.REGISTRY["upgrade"].describe(spec, ("a1",)),
                  "default_families": list(train_preset("smoke").cf_families)}))
two = parse_spec(text.replace("final: a1", "  - id: a2\n    base_role: solver\n    role: \"Checker\"\n"
                              "    duty: \"Check.\"\n    capacity: large\n    depends_on: [a1]\nfinal: a2"),
                 base_roles=P.roles_for(None))
insp = SpecInspector(two, SimpleNamespace(id="q1", question="1 + 1?"), B.get_benchmark("gsm8k"), None, prompts=P)
insp.family.value = "upgrade"
shown = {"options": list(insp.family.options), "sites": [list(o) for o in insp.site.options],
         "target": [insp.target.disabled, list(insp.target.options), insp.target.value]}
insp.site.value = ("a2",)  # large: the family's own edit is not possible there, any other value is
shown["a2"] = [list(insp.target.options), insp.target.value]
insp.site.value = ("a1",)
insp.apply_button.click()
shown["applied"] = [insp.current.agent("a1").capacity, insp.edits]
insp.family.value = "edge"
shown["edge_target_disabled"] = insp.target.disabled
default = StudyConfig.__dataclass_fields__["ablation_variants"].default
print(json.dumps({"inspector": shown, "study_default": list(default),
                  "study": list(study_preset("smoke", ablation_variants=("sft", "upgrade")).ablation_variants)}))
'''


def test_a_new_edit_family_is_one_record():
    """Issue 31: registering a toy family (raise a capacity one level) in edits.REGISTRY is all it takes for the
    trainer's config, the edit sampler, the family sampler, plots, testbed arms, study variants and the inspector to
    know it. Run in a fresh process: the record exists before the rest of lemon is imported, as if written in
    edits.py."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", TOY_FAMILY], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-2])
    assert r["edited"] == "medium" and r["span"] == "small" and r["family"] == "upgrade"
    assert r["config"] == ["upgrade"] and r["sampler"] == sorted([*FAMILIES, "upgrade"])
    assert r["label"] == "m_U (capacity +1)" and r["describe"] == "raise a1"
    assert r["arm"] == {"cf_lambda": 1.0, "cf_families": ["upgrade"]} and r["variant"] == {"cf_families": ["upgrade"]}
    assert r["default_families"] == [*FAMILIES, "upgrade"]
    s = json.loads(out.stdout.strip().splitlines()[-1])  # the inspector and the study config read the record too
    i = s["inspector"]
    assert i["options"] == [*FAMILIES, "upgrade"]
    assert i["sites"] == [["raise a1", ["a1"]], ["raise a2", ["a2"]]]  # a target family: every executed agent
    assert i["target"] == [False, ["medium", "large"], "medium"]  # enabled; the family's own edit is the default
    assert i["a2"] == [["small", "medium"], "small"] and i["edge_target_disabled"] is True
    assert i["applied"] == ["medium", ["capacity of a1: small → medium"]]
    assert s["study_default"] == ["global", "full", *FAMILIES, "upgrade"] and s["study"] == ["sft", "upgrade"]
